"""Config: flags, TANDEM_* variables, precedence, validation that names the flag."""

from dataclasses import dataclass, field

import pytest

from libs.common.config import CommonConfig, WorkerConfig
from libs.common.flags import require_positive


@dataclass
class DemoConfig(CommonConfig):
    SERVICE = "demo"
    workers: int = field(default=2, metadata={"help": "how many"})
    ratio: float = field(default=0.5, metadata={"help": "a ratio"})
    enabled: bool = field(default=False, metadata={"help": "on/off"})

    def validate(self) -> None:
        super().validate()
        require_positive(self, "workers")


def test_defaults_apply_without_flags_or_env():
    cfg = DemoConfig.parse([], env={})
    assert cfg.nats_url == "nats://127.0.0.1:4222"
    assert cfg.workers == 2 and cfg.enabled is False
    assert cfg.service_id.startswith("demo-")


def test_command_line_beats_service_env_beats_shared_env():
    env = {"TANDEM_WORKERS": "3", "TANDEM_DEMO_WORKERS": "4"}
    assert DemoConfig.parse([], env=env).workers == 4
    assert DemoConfig.parse([], env={"TANDEM_WORKERS": "3"}).workers == 3
    assert DemoConfig.parse(["--workers", "5"], env=env).workers == 5


def test_env_values_are_converted_to_field_types():
    cfg = DemoConfig.parse([], env={"TANDEM_RATIO": "0.25", "TANDEM_ENABLED": "true"})
    assert cfg.ratio == 0.25 and cfg.enabled is True


def test_bad_flag_value_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        DemoConfig.parse(["--workers", "0"], env={})
    assert exc.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_bad_env_value_names_flag_and_variable(capsys):
    with pytest.raises(SystemExit):
        DemoConfig.parse([], env={"TANDEM_DEMO_WORKERS": "many"})
    err = capsys.readouterr().err
    assert "--workers" in err and "TANDEM_DEMO_WORKERS" in err


def test_constructor_validation_raises_value_error_naming_flag():
    with pytest.raises(ValueError, match="--nats-url"):
        DemoConfig(nats_url="http://x")
    with pytest.raises(ValueError, match="--service-id"):
        DemoConfig(service_id="Has Spaces")
    with pytest.raises(ValueError, match="--log-level"):
        DemoConfig(log_level="loud")
    with pytest.raises(ValueError, match="--page-size"):
        WorkerConfig(page_size=0)


def test_help_lists_every_flag_with_env_and_default(capsys):
    with pytest.raises(SystemExit) as exc:
        DemoConfig.parse(["--help"], env={})
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--nats-url", "--service-id", "--log-level", "--log-format", "--workers"):
        assert flag in out
    assert "TANDEM_DEMO_WORKERS or TANDEM_WORKERS; default 2" in out


def test_redact_url_hides_passwords_but_keeps_user_and_host():
    from libs.common.config import redact_url

    url = "nats://tandem:s3cret@nats:4222,nats://127.0.0.1:4222"
    assert redact_url(url) == "nats://tandem:***@nats:4222,nats://127.0.0.1:4222"
    assert "s3cret" not in redact_url(url)
