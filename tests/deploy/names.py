"""What the deployment files may name: services, their flags' variables, the repo root."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from libs.common.flags import env_names
from scripts.healthcheck import SERVICES, config_class

REPO = Path(__file__).resolve().parents[2]


def flag_fields(service: str) -> list[str]:
    return [f.name for f in dataclasses.fields(config_class(service)) if f.init]


def env_vars(service: str) -> set[str]:
    """Every variable `service` reads: TANDEM_<SERVICE>_<FLAG> and TANDEM_<FLAG>."""
    return {name for field in flag_fields(service) for name in env_names(service, field)}


def shared_env_vars() -> set[str]:
    """TANDEM_<FLAG> of every flag some service has."""
    return {env_names(s, f)[1] for s in SERVICES for f in flag_fields(s)}


def service_module(command: list[str] | None) -> str | None:
    """`python -m services.<name> ...` -> name; anything else -> None."""
    if command and len(command) >= 3 and command[:2] == ["python", "-m"]:
        module = command[2]
        if module.startswith("services."):
            return module.removeprefix("services.")
    return None
