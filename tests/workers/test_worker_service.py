"""A worker's role name picks the roles composed on its one core: `both` is the union."""

from __future__ import annotations

import pytest

from libs.common.worker.service import WorkerService
from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig


def subjects(service: WorkerService) -> list[str]:
    return [endpoint.subject for endpoint in service.endpoints()]


def test_each_role_serves_its_own_endpoints_and_both_serves_the_union_on_one_core():
    decode = WorkerService(DecodeConfig(service_id="w1"), "decode")
    prefill = WorkerService(PrefillConfig(service_id="w1"), "prefill")
    both = WorkerService(DecodeConfig(service_id="w1"), "both")
    assert subjects(decode) == ["tandem.decode.w1.generate"]
    assert subjects(prefill) == ["tandem.prefill.w1.prefill", "tandem.prefill.w1.status"]
    assert subjects(both) == subjects(decode) + subjects(prefill)
    assert both.decode.core is both.prefill.core is both.core
    assert [s.details()["role"] for s in (decode, prefill, both)] == ["decode", "prefill", "both"]


def test_an_unknown_role_is_refused_by_name():
    with pytest.raises(ValueError, match="role"):
        WorkerService(DecodeConfig(service_id="w1"), "worker")
