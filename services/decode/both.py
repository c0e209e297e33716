"""The `both` worker (`python -m services.decode --role both`): prefill and decode in one
process, on one engine and one KV pool.

    generate (tandem.decode.<id>.generate)  as a decode worker: prefills its own prompt,
                                             or takes its KV from the prefill worker the
                                             router names
    prefill  (tandem.prefill.<id>.prefill)  as a prefill worker, for other decode workers

It reports load as role "both" (`tandem.workers.both.<id>.load`); the router counts it as
a decode worker that may prefill for itself and as a prefill worker for the others, and
/health is ready with one `both` worker alone. It composes this service's decode worker
with the library's prefill worker (libs/common/worker/prefill.py), not services/prefill.
"""

from __future__ import annotations

from libs.common.bus.connection import Endpoint
from libs.common.worker.decode import DecodeService
from libs.common.worker.prefill import PrefillService


class BothService(DecodeService, PrefillService):
    """A decode worker that is also a prefill worker (see the module docstring)."""

    description = "Tandem worker (prefill and decode)"
    role = "both"

    def endpoints(self) -> list[Endpoint]:
        return DecodeService.endpoints(self) + PrefillService.endpoints(self)
