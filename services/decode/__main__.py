"""The decode worker (`--role both`: the decode and prefill roles on one engine)."""

from libs.common.service import main
from libs.common.worker.service import WorkerService
from services.decode.config import DecodeConfig


def worker(config: DecodeConfig) -> WorkerService:
    return WorkerService(config, config.role, max_queue_delay=config.max_queue_delay)


main(worker, DecodeConfig)
