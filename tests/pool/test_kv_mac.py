"""Pool object MAC tags (libs/common/pool/integrity.py) and the master's rule for dropping
bad replicas (services/cache_master/metadata/reports.py), pure Python."""

import os

import pytest

from libs.common.messages.pool import PoolBadCopy
from libs.common.pool.integrity import TAG_RE, KvMac, load_kv_mac
from services.cache_master.metadata.metadata import PoolLimits, PoolMetadata
from services.cache_master.metadata.objects import PoolRequestError, PutSpec
from services.cache_master.metadata.reports import drop_bad
from tests.pool.test_metadata import CK, UNIT, meta_with

SECRET = b"0123456789abcdef0123456789abcdef"


def test_a_tag_verifies_only_the_same_key_and_bytes_under_the_same_secret():
    mac, data = KvMac(SECRET), os.urandom(4096)
    tag = mac.tag("page-1", data)
    assert TAG_RE.match(tag) and mac.verify("page-1", data, tag)
    assert not mac.verify("page-2", data, tag)  # the same bytes moved under another key
    assert not mac.verify("page-1", data[:-1], tag)  # truncated
    assert not mac.verify("page-1", bytes([data[0] ^ 1]) + data[1:], tag)  # one byte changed
    other = KvMac(b"another secret, also 32 bytes!!!")
    assert not other.mine(tag) and not other.verify("page-1", data, tag)
    assert other.key_id != mac.key_id


def test_key_and_length_are_bound_so_a_boundary_shift_does_not_verify():
    mac = KvMac(SECRET)
    assert mac.tag("ab", b"c" * 100) != mac.tag("abc", b"c" * 99)


def test_the_secret_file_is_read_without_surrounding_whitespace(tmp_path, monkeypatch):
    path = tmp_path / "kv.secret"
    path.write_bytes(SECRET + b"\n")
    assert load_kv_mac(str(path)).key_id == KvMac(SECRET).key_id
    monkeypatch.setenv("TANDEM_KV_SECRET_FILE", str(path))
    assert load_kv_mac().key_id == KvMac(SECRET).key_id
    monkeypatch.delenv("TANDEM_KV_SECRET_FILE")
    assert load_kv_mac() is None


@pytest.mark.parametrize("content", [b"", b"short\n", b"   \n"])
def test_a_short_or_empty_secret_is_refused_naming_the_flag(tmp_path, content):
    path = tmp_path / "kv.secret"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="--kv-secret-file"):
        KvMac.from_file(path)
    with pytest.raises(ValueError, match="--kv-secret-file"):
        KvMac.from_file(tmp_path / "missing")


def test_the_master_refuses_a_malformed_tag():
    meta = meta_with(1)
    with pytest.raises(PoolRequestError):
        meta.put_start([PutSpec("k", UNIT, CK, "not-a-tag")], 0, 0.0)


def report(key, store, offset, checksum=CK, mac=""):
    return PoolBadCopy(key, store, offset, checksum, mac)


def _two_replicas() -> tuple[PoolMetadata, list]:
    meta = PoolMetadata(PoolLimits(replicas=2))
    for i in range(2):
        meta.mount(f"s{i}", {"region_id": 100 + i, "length": 10 * UNIT}, [], now=0.0)
    put_id, results = meta.put_start([PutSpec("k", UNIT, CK, "")], 0, 0.0)
    meta.put_end(put_id, ["k"])
    return meta, results[0][2]


def test_a_report_that_does_not_match_the_record_drops_nothing():
    meta, replicas = _two_replicas()
    r = replicas[0]
    stale = [report("k", r.store_id, r.offset + 64), report("k", r.store_id, r.offset, "f" * 16),
             report("k", r.store_id, r.offset, mac="0" * 8 + "." + "0" * 32),
             report("other", r.store_id, r.offset), report("k", "nowhere", r.offset)]  # fmt: skip
    assert drop_bad(meta, stale, 0.0) == 0
    assert len(meta.objects["k"].replicas) == 2


def test_a_matching_report_drops_one_replica_and_its_range_waits_for_the_lease():
    meta, replicas = _two_replicas()
    meta.get(["k"], 0.0)  # the reader's lease, until lease_ttl (10 s)
    bad = replicas[0]
    used = meta.segments[bad.store_id].used
    assert drop_bad(meta, [report("k", bad.store_id, bad.offset)], 1.0) == 1
    assert [r.store_id for r in meta.objects["k"].replicas] == [replicas[1].store_id]
    assert "k" in meta.under_replicated  # copied back from the good replica
    assert meta.segments[bad.store_id].used == used  # leased: not freed yet
    meta.reap(11.0)
    assert meta.segments[bad.store_id].used == 0
    # The last replica: the object is gone.
    good = replicas[1]
    assert drop_bad(meta, [report("k", good.store_id, good.offset)], 12.0) == 1
    assert meta.exists(["k"]) == 0 and meta.segments[good.store_id].used == 0


def test_make_run_makes_one_private_secret_file_and_keeps_it(tmp_path):
    from scripts.cluster import kv_secret_file

    env = kv_secret_file({}, tmp_path / "run")
    path = tmp_path / "run" / "kv.secret"
    assert env == {"TANDEM_KV_SECRET_FILE": str(path)} and path.stat().st_mode & 0o777 == 0o600
    first = KvMac.from_file(path).key_id
    assert kv_secret_file({}, tmp_path / "run") == env and KvMac.from_file(path).key_id == first
    assert kv_secret_file({"TANDEM_KV_SECRET_FILE": "/elsewhere"}, tmp_path / "run") == {}


def test_a_store_index_keeps_tags_and_reads_an_index_saved_before_them(tmp_path):
    import orjson

    from libs.common.messages.pool import PoolRecord
    from services.cache_store.segment import INDEX_VERSION, StoreSegment, checksum

    data = bytearray(os.urandom(8192))
    segment = StoreSegment(memoryview(data), tmp_path / "seg", None)
    tag = KvMac(SECRET).tag("k", data[:4096])
    records = [PoolRecord("k", 0, 4096, checksum(data[:4096]), tag)]
    segment.save(records)
    assert segment.load() == records
    old = [("k", 0, 4096, checksum(data[:4096]))]  # a row of an index without tags
    segment.index_path.write_bytes(orjson.dumps({"v": INDEX_VERSION, "size": 8192,
                                                 "objects": old}))  # fmt: skip
    assert [r.mac for r in segment.load()] == [""]
