"""deploy/k8s runs each cache store with its SSD tier (issue 26, docs/pool.md "SSD tier") on
the volume that keeps its segment file, so a restart finds both."""

from pathlib import Path

from services.cache_store.config import parse_size
from tests.deploy.test_k8s import WORKLOADS, _containers, _env

_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _bytes(quantity: str) -> int:
    """A Kubernetes binary quantity (`24Gi`) -> bytes."""
    return int(quantity[:-2]) * _QUANTITY[quantity[-2:]]


def test_store_ssd_tier_and_segment_share_the_stores_own_volume():
    store = WORKLOADS["cache-store"]
    (container,) = _containers(store)
    env = {name: e.get("value") for name, e in _env(container).items()}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    ssd_dir = Path(env["TANDEM_CACHE_STORE_SSD_DIR"])
    segment = Path(env["TANDEM_CACHE_STORE_SEGMENT_FILE"])
    assert mounts[str(ssd_dir.parent)] == mounts[str(segment.parent)] == "data"
    (claim,) = store["spec"]["volumeClaimTemplates"]
    size = _bytes(claim["spec"]["resources"]["requests"]["storage"])
    need = parse_size(env["TANDEM_CACHE_STORE_SEGMENT_SIZE"])
    need += parse_size(env["TANDEM_CACHE_STORE_SSD_SIZE"])
    assert size >= need, f"the store's volume ({size} B) is smaller than segment + SSD ({need} B)"
