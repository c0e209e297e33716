"""When to speculate and how far: the draft length per request follows its acceptance.

    speculator.draft(running)            # before schedule(): seq.draft_ids set or emptied
    speculator.verified(seq, p, a)       # after verification: p proposed, a accepted
    speculator.release(request_id)       # the request is gone

Policy (pure Python, no torch). A step that verifies k drafts costs c[k] times a
one-token step and emits 1 + a + ... + a^k tokens on average when each draft holds with
probability a. c is measured as the engine runs (StepCosts: its own lone-sequence steps
by draft length), ROW_COST's table until enough steps of a length are seen. Per request,
`a` is a running estimate from its verified drafts, and the draft length is the k
(0 .. max_draft) with the most tokens per cost; k = 0 stops drafting for that request
for a while (4 steps, doubling up to 64 each time), then it tries one draft again. N-gram
drafts: at most MAX_STREAMS (2) running sequences draft, and together they verify at most
STEP_ROWS rows (the fused decode layer's, QuantLinear.GEMV_ROWS): a lone sequence up to 3
drafts, two sequences 1 each. Past it every product takes the panel form, dearer than
the drafts save; with three or more sequences none drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sequence import Sequence, SequenceStatus
from libs.common.engine.spec.ngram import NgramProposer
from libs.common.engine.spec.proposer import Proposer

# A step verifying k drafts against a one-token decode step (fused), k = 0, 1, ...: whole
# steps of the default model measured on the CPU (docs/engine.md, "Speculative
# decoding"), up to 3 drafts through the fused decode layer. Past 4 rows
# (QuantLinear.GEMV_ROWS) the products take the panel form and the layers run op by op.
ROW_COST = (1.0, 1.22, 1.45, 1.65, 3.45, 3.50, 3.60, 3.75, 3.90)
MAX_STREAMS = 2  # running sequences above which no step drafts (n-gram drafts)
STEP_ROWS = 4  # rows a step verifies at most across its sequences (n-gram drafts)
# The same for a draft model's proposals, which come batched (propose_many): not measured
# against this table yet, the bound it was written with.
DRAFT_MODEL_STREAMS = 8
FIRST_ACCEPTANCE = 0.75  # the estimate a request starts with: drafts from its first step
PROBE_ACCEPTANCE = 0.65  # after a pause: an estimate for which a short draft is worth trying
EMA_WEIGHT = 0.3  # weight of the last verification in the estimate
FIRST_PAUSE, MAX_PAUSE = 4, 64  # steps
# StepCosts: steps of a draft length seen before their measured cost replaces the table's,
# the weight of a new step in the running mean, and the drafts the fused decode layer
# verifies (QuantLinear.GEMV_ROWS - 1), within which an unmeasured length's cost is
# extrapolated from the longest measured one (past it, the table's jump to the panels).
COST_SAMPLES = 8
COST_WEIGHT = 0.1
FUSED_DRAFTS = 3


class StepCosts:
    """What a lone sequence's step costs by its number of drafts, relative to a one-token
    step (draft length 0): running means of the step times EngineCore.step reports
    (`add`), so the policy fits this host and model. ROW_COST (one model, one host) stands
    in until a length has COST_SAMPLES steps; within the fused layer's lengths an
    unmeasured one is extrapolated from the longest measured (cost linear in rows), so a
    cheap measured draft leads to trying longer ones. A step slower than twice the mean
    (the host busy with something else) counts as twice the mean."""

    def __init__(self, table: tuple[float, ...] = ROW_COST) -> None:
        self.table = table
        self._mean = [0.0] * len(table)
        self._count = [0] * len(table)
        self._relative = table

    def add(self, drafts: int, seconds: float) -> None:
        if not 0 <= drafts < len(self._mean) or seconds <= 0:
            return
        n, mean = self._count[drafts] + 1, self._mean[drafts]
        if n > COST_SAMPLES:
            seconds = min(seconds, 2 * mean)
        self._mean[drafts] = mean + max(COST_WEIGHT, 1 / n) * (seconds - mean)
        self._count[drafts] = n
        self._relative = self._estimate()

    def relative(self) -> tuple[float, ...]:
        """c[k] for k = 0 .. len(table) - 1 (c[0] = 1)."""
        return self._relative

    def _estimate(self) -> tuple[float, ...]:
        if self._count[0] < COST_SAMPLES:
            return self.table
        base = self._mean[0]
        out = [1.0]
        for k in range(1, len(self.table)):
            if self._count[k] >= COST_SAMPLES:
                out.append(self._mean[k] / base)
                continue
            known = [
                j for j in range(1, min(k, FUSED_DRAFTS + 1)) if self._count[j] >= COST_SAMPLES
            ]
            if k <= FUSED_DRAFTS and known:
                j = known[-1]
                out.append(1.0 + (out[j] - 1.0) * k / j)
            else:
                out.append(self.table[k])
        return tuple(out)

    def stats(self) -> dict[str, Any]:
        """For a worker's info: the costs in use and the steps measured per draft length."""
        return {"relative": [round(c, 3) for c in self._relative], "steps": list(self._count)}


@dataclasses.dataclass(slots=True)
class _State:
    acceptance: float = FIRST_ACCEPTANCE  # estimated probability that a draft holds
    pause: int = 0  # steps left without drafting
    backoff: int = FIRST_PAUSE  # the next pause's length


def best_draft_length(
    acceptance: float, max_draft: int, costs: tuple[float, ...] = ROW_COST
) -> int:
    """The draft length with the most expected tokens per step cost (0: none)."""
    best, best_rate = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, max_draft + 1):
        term *= acceptance
        expected += term
        cost = costs[k] if k < len(costs) else costs[-1] + 0.06 * (k - len(costs) + 1)
        if expected / cost > best_rate:
            best, best_rate = k, expected / cost
    return best


class Speculator:
    """Owns a Proposer and the per-request draft length. One caller (the engine thread)."""

    def __init__(self, proposer: Proposer, max_draft: int, max_streams: int = MAX_STREAMS,
                 step_rows: int | None = None) -> None:  # fmt: skip
        """`step_rows`: with two or more running sequences, the rows (a sequence's token
        and its drafts) of the step shared among them, each at most its equal share;
        None: no such bound."""
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.proposer = proposer
        self.max_draft = max_draft
        self.max_streams = max_streams
        self.step_rows = step_rows
        self._states: dict[str, _State] = {}
        self.costs = StepCosts()
        self.num_proposed = 0  # totals, for logs and tests
        self.num_accepted = 0

    def draft(self, running: list[Sequence]) -> None:
        """Set `draft_ids` of each running decoding sequence (empty: no draft this step)."""
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_ids = []
        streams = sum(1 for s in running if s.status == SequenceStatus.RUNNING)
        if streams > self.max_streams:
            return
        most = self.max_draft
        if streams > 1 and self.step_rows is not None:  # each its share of the step's rows
            most = min(most, self.step_rows // streams - 1)
            if most < 1:
                return
        for seq in running:
            if not _may_draft(seq):
                continue
            state = self._states.setdefault(seq.request_id, _State())
            if state.pause:
                state.pause -= 1
                if state.pause == 0:
                    state.acceptance = PROBE_ACCEPTANCE
                continue
            k = best_draft_length(state.acceptance, most, self.costs.relative())
            if k == 0:
                state.pause, state.backoff = state.backoff, min(MAX_PAUSE, 2 * state.backoff)
                continue
            # The last output token comes from the verification itself: never draft past
            # max_tokens.
            k = min(k, seq.sampling_params.max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                wanted.append((seq, k))
        # A proposer that drafts for several requests at once (a draft model: one batched
        # forward a draft position) gets them together.
        many = getattr(self.proposer, "propose_many", None)
        if many is not None and wanted:
            drafts = many([(seq.request_id, seq.token_ids, k) for seq, k in wanted])
        else:
            drafts = [self.proposer.propose(seq.request_id, seq.token_ids, k) for seq, k in wanted]
        for (seq, k), ids in zip(wanted, drafts, strict=True):
            seq.draft_ids = ids[:k]

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """`accepted` of the `proposed` drafts held (the sequence has its new tokens)."""
        self.proposer.accepted(seq.request_id, seq.num_tokens)
        state = self._states.get(seq.request_id)
        if state is None or proposed == 0:
            return
        self.num_proposed += proposed
        self.num_accepted += accepted
        # Drafts are checked in order up to the first rejection: `accepted` successes in
        # `trials` tries of a draft that holds with probability `acceptance`.
        trials = accepted + (accepted < proposed)
        state.acceptance += EMA_WEIGHT * (accepted / trials - state.acceptance)
        if accepted == proposed:
            state.backoff = FIRST_PAUSE

    def timed(self, item: Any, seconds: float) -> None:
        """A step whose one item (a ScheduledSeq) took `seconds`: a decode step of a lone
        sequence, with or without drafts, goes into the step costs."""
        decode = item.start >= item.seq.num_prompt_tokens
        if item.sample and decode and item.num_tokens == 1 + item.num_drafts:
            self.costs.add(item.num_drafts, seconds)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.proposer.release(request_id)


def _may_draft(seq: Sequence) -> bool:
    """A running sequence that decodes (one uncomputed token) and wants no prompt scores."""
    return (
        seq.status == SequenceStatus.RUNNING
        and seq.num_uncomputed_tokens == 1
        and not seq.prefill_only
        and seq.logits_from is None
    )


def make_speculator(
    config: EngineConfig, target: tuple[Any, Any] | None = None, pool_tokens: int = 0
) -> Speculator | None:
    """The speculator `config.speculation` names, or None ("off"). "draft" loads
    `config.draft_model` for `target` (the engine's model and tokenizer; ValueError when
    their vocabularies differ) with a KV pool of `pool_tokens` (the target's)."""
    if config.speculation == "ngram":
        return Speculator(NgramProposer(), config.speculation_max_draft, step_rows=STEP_ROWS)
    if config.speculation == "draft" and config.draft_model:
        if target is None:
            raise ValueError("speculation 'draft' needs the target model to check the draft")
        from libs.common.engine.spec.draft_load import load_draft_proposer  # torch

        proposer = load_draft_proposer(
            config.draft_model,
            target,
            weights=config.weights,
            max_requests=config.max_num_seqs,
            max_tokens=max(pool_tokens, config.page_size),
            page_size=config.page_size,
            chunk_tokens=config.max_num_batched_tokens,
        )
        return Speculator(proposer, config.speculation_max_draft, DRAFT_MODEL_STREAMS)
    return None
