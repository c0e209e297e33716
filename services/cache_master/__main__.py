from libs.common.service import main
from services.cache_master.config import CacheMasterConfig
from services.cache_master.service import CacheMasterService

main(CacheMasterService, CacheMasterConfig)
