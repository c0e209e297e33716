from libs.common.service import main
from services.decode.both import BothService
from services.decode.config import DecodeConfig
from services.decode.service import DecodeService


def worker(config: DecodeConfig) -> DecodeService:
    return BothService(config) if config.role == "both" else DecodeService(config)


main(worker, DecodeConfig)
