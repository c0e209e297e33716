from libs.common.service import main
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService

main(PrefillService, PrefillConfig)
