"""Write the default model as a Hugging Face folder, for `transformers serve` (the peer).

    python -m bench.peer_model run/smollm2-hf

transformers loads the GGUF file (dequantizing Q4_1 to fp32, the weights Tandem computes
with) but neither serves a GGUF by path nor saves a GGUF-quantized model, so the tensors
are copied into a plain LlamaForCausalLM and saved with the tokenizer and chat template.
"""

from __future__ import annotations

import sys
from pathlib import Path

from libs.common.engine.load.source import default_model_path


def write(out: Path, src=None) -> None:
    """Save the default model to `out`; `src` is that model already loaded by transformers
    from the GGUF (loaded here when None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = Path(default_model_path())
    if src is None:
        src = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype="float32"
        )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    skip = ("quantization_config", "architectures")
    cfg = LlamaConfig(**{k: v for k, v in src.config.to_dict().items() if k not in skip})
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # tied to the embedding
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    write(Path(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
