"""Loading a draft model for `DraftModelProposer`, refused unless it speaks the target's
vocabulary.

A draft proposes token ids that the target verifies, so an id must name the same token
for both: the two tokenizers must map every token string to the same id (merges,
normalizers and chat templates may differ: they change how text becomes ids, not what an
id means). A draft whose embedding has more rows than the target's vocabulary (padding)
proposes only ids the target has.
"""

from __future__ import annotations

import structlog

from libs.common.engine.load.source import load_model
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.spec.draft import DraftModelProposer

log = structlog.get_logger(__name__)


def check_same_vocabulary(
    name: str,
    draft: tuple[LlamaModel, TextTokenizer | None],
    target: tuple[LlamaModel, TextTokenizer | None],
) -> None:
    """ValueError naming `name` (the draft's path) unless the draft's token ids mean what
    the target's do. Without a tokenizer on either side (models built in tests), the two
    vocabularies must at least be the same size."""
    (draft_model, draft_tok), (target_model, target_tok) = draft, target
    dv, tv = draft_model.config.vocab_size, target_model.config.vocab_size
    if draft_tok is None or target_tok is None:
        if dv != tv:
            raise ValueError(
                f"draft_model {name!r}: its vocabulary has {dv} tokens, the target's {tv} "
                "(a draft must use the target's tokenizer)"
            )
        return
    mine = draft_tok.tokenizer.get_vocab(with_added_tokens=True)
    theirs = target_tok.tokenizer.get_vocab(with_added_tokens=True)
    if mine != theirs:
        mine_by_id = {i: t for t, i in mine.items()}
        theirs_by_id = {i: t for t, i in theirs.items()}
        differ = sorted(
            i
            for i in mine_by_id.keys() | theirs_by_id.keys()
            if mine_by_id.get(i) != theirs_by_id.get(i)
        )
        first = differ[0] if differ else -1
        raise ValueError(
            f"draft_model {name!r}: its tokenizer differs from the target's ({len(mine)} "
            f"against {len(theirs)} tokens, {len(differ)} ids differ; id {first} is "
            f"{mine_by_id.get(first)!r} in the draft, {theirs_by_id.get(first)!r} in the "
            "target); a draft must use the target's tokenizer"
        )
    if dv < len(theirs):
        raise ValueError(
            f"draft_model {name!r}: its embedding has {dv} rows for a vocabulary of "
            f"{len(theirs)} tokens"
        )


def load_draft_proposer(
    name: str,
    target: tuple[LlamaModel, TextTokenizer | None],
    *,
    weights: str = "native",
    max_requests: int,
    max_tokens: int,
    page_size: int = 16,
    chunk_tokens: int = 2048,
) -> DraftModelProposer:
    """The draft model `name` ("default", a .gguf file or an HF folder, read with the
    engine's loader in the form `weights`) as a proposer for `target` (model, tokenizer)."""
    loaded, tokenizer = load_model(name, weights)
    model = LlamaModel(loaded)
    check_same_vocabulary(name, (model, tokenizer), target)
    proposer = DraftModelProposer(
        model,
        max_requests=max_requests,
        max_tokens=max_tokens,
        page_size=page_size,
        chunk_tokens=chunk_tokens,
        vocab_limit=target[0].config.vocab_size,
    )
    c = model.config
    log.info(
        "draft.ready",
        model_id=model.model_id,
        params=c.num_params,
        layers=c.num_layers,
        max_requests=max_requests,
        max_tokens=proposer.kv_cache.num_pages * page_size,
        kv_mib=proposer.kv_cache.buffer.numel() * proposer.kv_cache.buffer.element_size() >> 20,
    )
    return proposer
