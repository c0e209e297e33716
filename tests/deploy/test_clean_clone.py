"""The make targets that write under run/ work in a clean clone, where run/ does not exist.

`make upgrade-test` once opened run/compose-test/dockerd.log (`make compose-test`'s folder)
before any target had made it: FileNotFoundError on a machine where compose-test never
ran. Here the repository's files (tracked and new, as `git clone` plus the working tree's
changes would give) are copied into a fresh folder, and each script runs there up to the
point where it needs Docker, with a PATH on which no program is found: each must stop
with its own "FAILED: ..." message, never a traceback, and write its logs in its own
run folder. Docker is not needed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.cluster import REPO

SETUP = """
from scripts import compose_stack, compose_test, upgrade_test
for workdir in (compose_test.WORKDIR, upgrade_test.WORKDIR):
    try:
        compose_stack.ensure_dockerd(workdir, timeout=5)
    except compose_stack.StepFailed as e:
        print("refused:", e)
    stack = compose_stack.Stack(["docker", "compose"], workdir=workdir)
    print("env file:", stack.env_file)
"""


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The repository's files without run/ or any ignored path, in a new folder."""
    dest = tmp_path_factory.mktemp("clone")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                            capture_output=True, check=True, timeout=60).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree is listed, not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    assert not (dest / "run").exists()
    return dest


def _python(clone: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    bare = tmp_path / "bin"  # a PATH where docker, dockerd and apt-get are not found
    bare.mkdir(exist_ok=True)
    env = {"PATH": str(bare), "HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("script", ["scripts.upgrade_test", "scripts.compose_test"])
def test_a_target_without_its_tools_fails_with_a_message_not_a_traceback(clone, tmp_path, script):
    done = _python(clone, tmp_path, "-m", script)
    assert done.returncode == 1, done.stderr
    assert "FAILED: apt-get: cannot run it" in done.stderr
    assert "Traceback" not in done.stderr and "FileNotFoundError" not in done.stderr


def test_docker_setup_writes_each_target_s_logs_in_its_own_new_run_folder(clone, tmp_path):
    shutil.rmtree(clone / "run", ignore_errors=True)  # as cloned, whatever ran before
    done = _python(clone, tmp_path, "-c", SETUP)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused: no Docker engine answers and dockerd cannot start") == 2
    for target in ("compose-test", "upgrade-test"):
        folder = clone / "run" / target
        assert (folder / "dockerd.log").is_file()
        assert "TANDEM_IMAGE=" in (folder / "compose.env").read_text()
