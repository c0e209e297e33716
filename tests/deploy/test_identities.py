"""scripts.identities: secrets made once and kept, private, and handed out one per volume."""

from __future__ import annotations

import json
import stat

import pytest

from libs.common.bus.credentials import parse_credentials
from scripts.identities import AUTH_CONF, DEFAULT_IDENTITIES, Identity, ensure, main


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_private_and_kept_across_runs(tmp_path):
    folder = tmp_path / "secrets"
    first = {name: path.read_text() for name, path in ensure(folder).items()}
    kv = (folder / "kv.secret").read_text()
    assert set(first) == {i.name for i in DEFAULT_IDENTITIES}
    again = {name: path.read_text() for name, path in ensure(folder).items()}
    assert again == first and (folder / "kv.secret").read_text() == kv
    assert _mode(folder) == 0o700
    assert all(_mode(p) == 0o600 for p in folder.iterdir())
    passwords = {parse_credentials(text).password for text in first.values()}
    assert len(passwords) == len(first)  # one password per identity
    conf = (folder / AUTH_CONF).read_text()
    assert all(p in conf for p in passwords)


def test_the_users_file_lists_exactly_the_identities_asked_for(tmp_path):
    folder = tmp_path / "secrets"
    ensure(folder)
    ensure(folder, [Identity("decode-1", "decode", "decode-1")], kv_secret=False)
    conf = (folder / AUTH_CONF).read_text()
    assert conf.count("user:") == 1 and '"tandem.workers.decode.decode-1.load"' in conf


def test_export_copies_each_piece_only_into_a_folder_meant_for_it(tmp_path):
    target = tmp_path / "export"
    for name in ("router", "cli", "kv", "nats"):
        (target / name).mkdir(parents=True)
    assert main([str(tmp_path / "secrets"), "--export", str(target)]) == 0
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert files == ["cli/context/tandem.json", "cli/credentials", "kv/kv.secret",
                     f"nats/{AUTH_CONF}", "router/credentials"]  # fmt: skip
    router = (tmp_path / "secrets" / "router.credentials").read_text()
    assert (target / "router" / "credentials").read_text() == router
    context = json.loads((target / "cli" / "context" / "tandem.json").read_text())
    assert context["user"] == "cli" and context["inbox_prefix"] == "_INBOX.cli"
    assert all(_mode(p) == 0o600 for p in target.rglob("*") if p.is_file())


@pytest.mark.parametrize("text", ["x=nobody", "x", "bad name=router", "d=decode@a.b", "r=router@"])
def test_a_bad_identity_is_refused_by_name(text):
    if text == "r=router@":  # an empty id means any instance
        assert Identity.parse(text) == Identity("r", "router", "*")
        return
    with pytest.raises(ValueError, match="--identity"):
        Identity.parse(text)
