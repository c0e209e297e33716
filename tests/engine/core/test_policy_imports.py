"""Scheduling policy stays pure Python: importing it never loads torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

POLICY = [
    "libs.common.engine.core.kv_hash",
    "libs.common.engine.core.radix_cache",
    "libs.common.engine.core.page_allocator",
    "libs.common.engine.core.sampling_params",
    "libs.common.engine.core.sequence",
    "libs.common.engine.core.kv_pages",
    "libs.common.engine.core.scheduler",
]

ROOT = Path(__file__).resolve().parents[3]  # the repository root, for `import libs`


def test_policy_modules_never_import_torch():
    code = f"import sys\nfor m in {POLICY!r}: __import__(m)\nprint('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.strip() == "False"
