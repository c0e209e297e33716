"""The worker's engine as its flags describe it, and what `info` reports of it.

engine_config(flags)            -> the EngineConfig a worker starts its Engine with
speculation_stats(flags, core)  -> speculative decoding's mode and draft totals
"""

from __future__ import annotations

from typing import Any

from libs.common.config import WorkerConfig
from libs.common.engine.config import EngineConfig
from libs.common.engine.step_loop import EngineCore


def engine_config(flags: WorkerConfig) -> EngineConfig:
    """Every engine option a worker flag sets; the KV pool is the worker's own tier."""
    return EngineConfig(
        model=flags.model,
        page_size=flags.page_size,
        kv_cache_mb=flags.kv_cache_mb,
        max_num_seqs=flags.max_num_seqs,
        max_num_batched_tokens=flags.max_num_batched_tokens,
        enable_prefix_cache=not flags.no_prefix_cache,
        decode_mirror=not flags.no_decode_mirror,
        kv_dtype=flags.kv_dtype,
        weights=flags.weights,
        kernel_choice=flags.kernel_choice,
        kernel_copy_mb=flags.kernel_copy_mb,
        speculation=flags.speculation,
        draft_model=flags.draft_model or None,
        speculation_max_draft=flags.speculation_max_draft,
        num_threads=flags.num_threads or None,
        tier="device",
    )


def speculation_stats(flags: WorkerConfig, core: EngineCore | None) -> dict[str, Any]:
    """The mode, the draft tokens verified and accepted since the engine started (zeros
    while speculation is off or the engine is not started) and the step costs in use."""
    spec = core.speculator if core is not None else None
    return {
        "mode": flags.speculation,
        "max_draft": flags.speculation_max_draft,
        "drafts_proposed": spec.num_proposed if spec is not None else 0,
        "drafts_accepted": spec.num_accepted if spec is not None else 0,
        # the policy's step costs by draft length, measured on this worker (StepCosts)
        "step_costs": spec.costs.stats() if spec is not None else None,
    }
