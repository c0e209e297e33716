"""What a worker's flags make of its engine: speculation's flags reach the EngineConfig,
take exactly the engine's modes, and `info`'s totals start at zero."""

from __future__ import annotations

import pytest

from libs.common.engine.config import SPECULATION
from libs.common.worker.engine_setup import engine_config, speculation_stats
from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig


def test_speculation_is_on_by_default_and_its_flags_reach_the_engine():
    assert engine_config(DecodeConfig.parse([], env={})).speculation == "ngram"
    flags = DecodeConfig.parse(["--speculation", "off", "--speculation-max-draft", "3"], env={})
    config = engine_config(flags)
    assert (config.speculation, config.speculation_max_draft) == ("off", 3)
    drafted = engine_config(DecodeConfig.parse(["--speculation", "draft", "--draft-model",
                                                "default"], env={}))  # fmt: skip
    assert (drafted.speculation, drafted.draft_model) == ("draft", "default")
    env = {"TANDEM_PREFILL_SPECULATION": "off"}
    assert engine_config(PrefillConfig.parse([], env=env)).speculation == "off"


def test_the_speculation_flag_takes_exactly_the_engines_modes():
    (field,) = [f for f in DecodeConfig.__dataclass_fields__.values() if f.name == "speculation"]
    assert set(field.metadata["choices"]) == set(SPECULATION)


@pytest.mark.parametrize("argv, flag", [(["--speculation", "eagle"], "--speculation"),
                                        (["--speculation-max-draft", "0"],
                                         "--speculation-max-draft")])  # fmt: skip
def test_a_bad_speculation_flag_exits_2_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        DecodeConfig.parse(argv, env={})
    assert info.value.code == 2 and flag in capsys.readouterr().err


def test_info_reports_the_mode_and_zero_drafts_before_the_engine_starts():
    flags = DecodeConfig.parse(["--speculation-max-draft", "5"], env={})
    stats = speculation_stats(flags, None)
    assert stats == {"mode": "ngram", "max_draft": 5, "drafts_proposed": 0, "drafts_accepted": 0,
                     "step_costs": None}  # fmt: skip
