"""Scheduling policy stays pure Python: importing it never loads torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

POLICY = [
    "libs.common.kv_hash",
    "libs.common.radix_cache",
    "libs.common.engine.page_allocator",
    "libs.common.engine.sampling_params",
    "libs.common.engine.sequence",
    "libs.common.engine.kv_pages",
    "libs.common.engine.scheduler",
]

ROOT = Path(__file__).resolve().parents[2]  # the repository root, for `import libs`


def test_policy_modules_never_import_torch():
    code = f"import sys\nfor m in {POLICY!r}: __import__(m)\nprint('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.strip() == "False"
