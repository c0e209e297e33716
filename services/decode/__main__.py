from libs.common.service import main
from libs.common.worker.decode import DecodeService
from services.decode.both import BothService
from services.decode.config import DecodeConfig


def worker(config: DecodeConfig) -> DecodeService:
    return BothService(config) if config.role == "both" else DecodeService(config)


main(worker, DecodeConfig)
