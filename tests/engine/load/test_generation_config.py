"""A model's sampling defaults: read from generation_config.json or GGUF metadata, checked
against the API's bounds; the default model, whose file has none, gets built-in ones."""

from __future__ import annotations

import json

import gguf
import pytest

from libs.common.engine.load.generation_config import (
    DEFAULT_MODEL_SAMPLING,
    DEFAULT_MODEL_SOURCE,
    model_sampling_defaults,
    read_generation_config,
)
from libs.common.engine.load.source import default_model_path


def hf_folder(tmp_path, generation_config: dict | None):
    (tmp_path / "config.json").write_text("{}")
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(tmp_path)


def test_hf_generation_config_gives_the_sampling_fields_and_ignores_the_rest(tmp_path):
    folder = hf_folder(
        tmp_path,
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None,
         "repetition_penalty": 1.05, "max_new_tokens": 7, "eos_token_id": 2},
    )  # fmt: skip
    assert read_generation_config(folder) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
    }  # fmt: skip


def test_do_sample_false_means_greedy_whatever_the_temperature(tmp_path):
    folder = hf_folder(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": 0.8})
    assert read_generation_config(folder) == {"temperature": 0.0, "top_p": 0.8}


def test_an_hf_folder_without_a_generation_config_has_no_defaults(tmp_path):
    assert read_generation_config(hf_folder(tmp_path, None)) == {}
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 1}')
    assert read_generation_config(str(tmp_path)) == {}


@pytest.mark.parametrize(
    ("key", "value"),
    [("temperature", 3), ("top_p", 0), ("top_k", 1.5), ("min_p", -0.1),
     ("repetition_penalty", 0), ("temperature", "hot"), ("do_sample", "yes")],
)  # fmt: skip
def test_a_bad_value_in_the_file_is_a_value_error_naming_file_and_key(tmp_path, key, value):
    folder = hf_folder(tmp_path, {key: value})
    with pytest.raises(ValueError, match=r"generation_config\.json") as e:
        read_generation_config(folder)
    assert f"'{key}'" in str(e.value)


def test_a_file_that_is_not_json_is_a_value_error_naming_it(tmp_path):
    folder = hf_folder(tmp_path, None)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        read_generation_config(folder)


def test_a_gguf_without_sampling_metadata_has_no_defaults():
    assert read_generation_config(default_model_path()) == {}


def write_gguf(path, **fields) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in fields.items():
        writer.add_key_value(key, value, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return str(path)


def test_a_gguf_with_sampling_metadata_gives_it_by_field_name(tmp_path):
    f32, i32 = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.INT32
    path = write_gguf(
        tmp_path / "m.gguf",
        **{"general.sampling.temp": (f32, 0.5), "general.sampling.top_k": (i32, 40),
           "general.sampling.penalty_repeat": (f32, 1.25), "general.sampling.mirostat": (i32, 2)},
    )  # fmt: skip
    assert read_generation_config(path) == {
        "temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25,
    }  # fmt: skip


def test_a_bad_gguf_sampling_value_names_the_metadata_key(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf", **{"general.sampling.top_p": (gguf.GGUFValueType.FLOAT32, 2.0)}
    )
    with pytest.raises(ValueError, match=r"general\.sampling\.top_p"):
        read_generation_config(path)


def test_the_default_model_gets_built_in_defaults_and_a_folder_its_own(tmp_path):
    assert model_sampling_defaults("default") == (
        DEFAULT_MODEL_SAMPLING, DEFAULT_MODEL_SOURCE,
    )  # fmt: skip
    folder = hf_folder(tmp_path, {"top_k": 5})
    assert model_sampling_defaults(folder) == ({"top_k": 5}, f"{folder}/generation_config.json")
