"""The prefill worker: computes prompts and hands their KV to a decode worker."""

from libs.common.service import main
from libs.common.worker.service import WorkerService
from services.prefill.config import PrefillConfig


def worker(config: PrefillConfig) -> WorkerService:
    return WorkerService(config, "prefill")


main(worker, PrefillConfig)
