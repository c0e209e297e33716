from libs.common.service import main
from libs.common.worker.prefill import PrefillService
from services.prefill.config import PrefillConfig

main(PrefillService, PrefillConfig)
