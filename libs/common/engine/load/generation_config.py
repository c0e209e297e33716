"""A model's own sampling defaults: what its files recommend for the fields a request omits.

An HF folder may carry them in generation_config.json, a GGUF file in `general.sampling.*`
metadata. Only the fields below are read; every value is checked against the bounds the API
checks requests against (engine.core.sampling_params, standard library only), so a bad file
stops the process at start-up with the file and the key named, not each request later.

The packaged default model (SmolLM2-135M-Instruct) has neither: its generation_config.json
on Hugging Face holds token ids only. It gets `DEFAULT_MODEL_SAMPLING` instead: at
temperature 1 this 135M model mostly answers nonsense (docs/api.md, "Defaults", has the
measurement behind each value).

No torch (the router reads this): the standard library, gguf, and the model source.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import gguf

from libs.common.engine.core.sampling_params import BOUNDS, SamplingError
from libs.common.engine.load.gguf import metadata_reader
from libs.common.engine.load.source import resolve_model_path

# The sampling fields a model may recommend (SamplingParams's names).
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# temperature and top_p: what SmolLM2-135M-Instruct's model card samples with; the
# repetition penalty keeps it out of the loops it otherwise falls into, which run to the
# context limit when a request sets no max_tokens (docs/api.md, "Defaults").
DEFAULT_MODEL_SAMPLING: dict[str, int | float] = {
    "temperature": 0.2,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
}
DEFAULT_MODEL_SOURCE = "built-in defaults of the default model"

_GGUF_KEYS = {
    gguf.Keys.General.SAMPLING_TEMP: "temperature",
    gguf.Keys.General.SAMPLING_TOP_P: "top_p",
    gguf.Keys.General.SAMPLING_TOP_K: "top_k",
    gguf.Keys.General.SAMPLING_MIN_P: "min_p",
    gguf.Keys.General.SAMPLING_PENALTY_REPEAT: "repetition_penalty",
}


def read_generation_config(path: str) -> dict[str, int | float]:
    """The sampling defaults stored with the model at `path` (a .gguf file or an HF folder),
    by SamplingParams's field names; {} when it stores none. ValueError naming the file and
    the key for a value out of its bounds or a file that is not JSON."""
    if path.endswith(".gguf"):
        return _from_gguf(path)
    file = pathlib.Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return _from_hf(data, str(file))


def model_sampling_defaults(model: str) -> tuple[dict[str, int | float], str]:
    """The defaults of `model` (a --model value) and where they come from: its stored ones,
    or for the packaged default model, which stores none, DEFAULT_MODEL_SAMPLING."""
    path = resolve_model_path(model)
    stored = read_generation_config(path)
    if model == "default" and not stored:
        return dict(DEFAULT_MODEL_SAMPLING), DEFAULT_MODEL_SOURCE
    if path.endswith(".gguf"):
        return stored, f"{pathlib.Path(path).name} general.sampling metadata"
    return stored, str(pathlib.Path(path) / "generation_config.json")


def _from_hf(data: dict[str, Any], where: str) -> dict[str, int | float]:
    given = [name for name in FIELDS if data.get(name) is not None]  # null: not given
    out = {name: _check(where, name, name, data[name]) for name in given}
    do_sample = data.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"{where}: 'do_sample' must be true or false, got {do_sample!r}")
    if do_sample is False:  # transformers then decodes greedily whatever the temperature
        out["temperature"] = 0.0
    return out


def _from_gguf(path: str) -> dict[str, int | float]:
    reader = metadata_reader(path)  # the tokenizer's, when it was read already
    out = {}
    for key, name in _GGUF_KEYS.items():
        field = reader.fields.get(key)
        if field is not None:
            out[name] = _check(path, key, name, field.contents())
    return out


def _check(where: str, key: str, name: str, value: Any) -> int | float:
    try:
        return BOUNDS[name].check(name, value)
    except SamplingError as e:
        raise ValueError(f"{where}: {key!r}: {e}") from None
