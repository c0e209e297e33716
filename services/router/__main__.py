from libs.common.service import main
from services.router.config import RouterConfig
from services.router.service import RouterService

main(RouterService, RouterConfig)
