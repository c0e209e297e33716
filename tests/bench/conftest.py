"""Fixtures of the bench tests."""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def structlog_config_restored():
    """A bench's main() points structlog at the test's captured stderr, closed after the
    test: the configuration before it comes back, after every bench test (a later test's
    log line would write to the closed file)."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
