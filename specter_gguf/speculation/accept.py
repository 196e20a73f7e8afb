"""Acceptance: which drafted tokens the target keeps, and the target's own token after them.

Greedy: d_i is kept while it is the target's own choice. Sampled: d_i is kept with probability
min(1, p(d_i) / q(d_i)), otherwise the token is drawn from max(0, p - q) normalized (speculative sampling), where
p and q are the target's and the draft's distributions after the sampling chain. Either way the output is
distributed exactly as the target's alone (greedy: the same tokens).

Without penalties both run on the device, as verdicts of the steps (`steps.judge`, `SampledVerdict`): one host
read per iteration. With penalties (which depend on the tokens drafted so far) `accept_drafts` decides on the
host.

Synthetic acceptance (benchmarks only, `synthetic_acceptance`) is llama.cpp's `--spec-synth-len L`: whatever the
target says, each drafted token is kept with probability p once the one before it was, p chosen so that a depth
of n_max (llama.cpp's `--spec-draft-n-max`) keeps p + p^2 + ... + p^n_max = L - 1 drafts on average: the mean
accepted length per verification at that depth, the target's token included, is L. A real draft of per-token
acceptance p behaves so, shallower depths included. The compute and data movement are real, the text is not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specter_gguf.errors import SpecterError
from specter_gguf.sampling import (Sampler, SamplingParams, chain_candidates, chain_knobs, chain_sample,
                                   chain_workspace, draw_rows, probabilities_at)

if TYPE_CHECKING:
    from specter_gguf.engine import Model


def accept_drafts(verified: torch.Tensor, drafted: list[int], draft_probs: list[torch.Tensor] | None,
                  sampler: Sampler, history: list[int], synth_rate: float | None = None) -> tuple[list[int], int]:
    """The accepted prefix of `drafted` and the target's token after it, from the target's logits `verified`
    [k+1, n_vocab] after the last token of `history` and after each drafted one. `draft_probs`: the draft
    distributions the tokens were drawn from (None: greedy drafting); `synth_rate`: synthetic acceptance's p."""
    seen = [*history]
    if synth_rate is not None:
        n = synthetic_count(sampler, len(drafted), synth_rate)
        return drafted[:n], sampler.sample(verified[n], [*seen, *drafted[:n]])
    for i, d in enumerate(drafted):
        if draft_probs is None:
            target = sampler.sample(verified[i], seen)
            if target != d:
                return drafted[:i], target
        else:
            p, q = sampler.probabilities(verified[i], seen), draft_probs[i]
            if sampler.random() * q[d] >= p[d]:  # rejected: accept with probability min(1, p/q)
                return drafted[:i], draw_residual(sampler, p, q)
        seen.append(d)
    return drafted, sampler.sample(verified[len(drafted)], seen)


def draw_residual(sampler: Sampler, p: torch.Tensor, q: torch.Tensor) -> int:
    """The token after a rejected draft: drawn from max(0, p - q) normalized (from p when that is all zero,
    which only rounding can cause: a rejection means p < q somewhere, hence p > q elsewhere)."""
    residual = (p - q).clamp(min=0)
    return sampler.draw(residual if float(residual.sum()) > 0 else p)


class VerdictRows:
    """The device buffers of `SampledVerdict`s of up to `n_tokens` tokens over `n_candidates` candidates of `n_vocab`
    logits. A verdict of fewer tokens takes views of their first rows (and the chain's workspace), so that the
    verifications of every depth share one set: with top-k off they span the vocabulary (41 MB for 9 tokens of
    Qwen's 151,936), a set per depth 194 MB over the depths 1-8."""

    def __init__(self, n_tokens: int, n_candidates: int, n_vocab: int, device: torch.device) -> None:
        self.n_tokens, self.n_candidates, self.n_vocab, self.device = n_tokens, n_candidates, n_vocab, device
        C = n_candidates
        self.uniforms = torch.zeros(n_tokens, dtype=torch.float64, device=device)
        self.draft_ids = torch.zeros(n_tokens - 1, C, dtype=torch.long, device=device)
        self.draft_probs = torch.zeros(n_tokens - 1, C, dtype=torch.float64, device=device)
        self.ids = torch.zeros(n_tokens, C, dtype=torch.long, device=device)
        self.probs = torch.zeros(n_tokens, C, dtype=torch.float64, device=device)
        self.workspace = chain_workspace(n_tokens, n_vocab, C, device)


class SampledVerdict:
    """Speculative sampling on the device, as the verdict of `n_tokens`-token steps (`steps.Steps`; the same
    outputs as `steps.judge`): the tokens [t, d_1 .. d_k] (k = n_tokens - 1), the draft's distributions they were
    drawn from (`draft_ids`, `draft_probs` [k, C]: the candidates of `sampling.chain_sample`) and
    `uniforms` [n_tokens] (k acceptance tests, one draw) give n accepted and the token after them, drawn from the
    residual of the first rejected row or from the last row. A one-token step (k = 0) is a plain draw: a drafted
    token, whose distribution stays in `ids`, `probs`. Every distribution is held as its C candidates, so no
    tensor spans the vocabulary unless top-k is off. The buffers are views of `rows` (shared with the verdicts of
    other depths; None: its own). The sampling settings are a device tensor (`set`), so one captured graph serves
    every temperature."""

    def __init__(self, params: SamplingParams, n_tokens: int, n_vocab: int, device: torch.device,
                 rows: VerdictRows | None = None) -> None:
        self.n_candidates = C = chain_candidates(params, n_vocab)
        self._knobs = chain_knobs(params)
        self.knobs = self._knobs.to(device)
        if rows is None:
            rows = VerdictRows(n_tokens, C, n_vocab, device)
        elif rows.n_tokens < n_tokens or rows.n_candidates != C or rows.n_vocab != n_vocab:
            raise SpecterError(f"verdict rows of {rows.n_tokens} tokens and {rows.n_candidates} of {rows.n_vocab} "
                               f"candidates cannot hold a verdict of {n_tokens} tokens and {C} of {n_vocab}")
        self.workspace = rows.workspace
        self.uniforms = rows.uniforms[:n_tokens]
        self.draft_ids, self.draft_probs = rows.draft_ids[:n_tokens - 1], rows.draft_probs[:n_tokens - 1]
        self.ids, self.probs = rows.ids[:n_tokens], rows.probs[:n_tokens]

    def set(self, params: SamplingParams) -> None:
        """Sample with `params` from now on (the same top_k); copies only what changed (a copy from pageable
        memory waits for the device)."""
        knobs = chain_knobs(params)
        if not torch.equal(knobs, self._knobs):
            self._knobs = knobs
            self.knobs.copy_(knobs)

    def take_uniforms(self, sampler: Sampler) -> None:
        """The sampler's next uniforms (one a token, as its own draws take them) into `uniforms`, without waiting."""
        u = sampler.uniforms(self.uniforms.numel())
        self.uniforms.copy_(u.pin_memory() if self.uniforms.is_cuda else u, non_blocking=True)

    def __call__(self, logits: torch.Tensor, inputs: torch.Tensor, choice: torch.Tensor, next: torch.Tensor,
                 finite: torch.Tensor) -> None:
        T = logits.shape[0]
        k, pos = T - 1, inputs[T:]
        finite.copy_(torch.isfinite(logits.amax(-1)).all().view(1))
        if T == 1:  # a draft step (or a target step with nothing drafted): a draw from the chain, straight to choice
            chain_sample(logits, self.n_candidates, self.knobs, self.uniforms, (self.ids, self.probs, choice[1:]),
                         self.workspace)
            choice[:1].zero_()
            next[:1].copy_(choice[1:])
            torch.add(pos, 1, out=next[1:])
            return
        ids, p, _ = chain_sample(logits, self.n_candidates, self.knobs, out=(self.ids, self.probs, None),
                                 workspace=self.workspace)
        drafted = inputs[1:T, None]
        q_ids, q = self.draft_ids, self.draft_probs
        p_drafted = probabilities_at(ids[:k], p[:k], drafted).squeeze(1)
        kept = self.uniforms[:k] * probabilities_at(q_ids, q, drafted).squeeze(1) < p_drafted
        n = kept.long().cumprod(0).sum(0, keepdim=True)
        # max(0, p - q) is 0 outside p's candidates: the residual lives on them
        residual = (p[:k] - probabilities_at(q_ids, q, ids[:k])).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])  # all zero: rounding only
        after = draw_rows(ids.index_select(0, n), torch.cat([residual, p[k:]]).index_select(0, n), self.uniforms[k:])
        rows = torch.arange(T, device=logits.device)
        choice.copy_(torch.cat([n, torch.where(rows < n, torch.cat([inputs[1:T], after]), after)]))
        next.copy_(torch.cat([after, pos + n + 1]))


def synthetic_rate(synth_len: float, n_max: int) -> float:
    """Synthetic acceptance's p for a mean accepted length `synth_len` at depth `n_max` (module docstring), found
    by bisection as llama.cpp does."""
    if not 1 <= synth_len <= n_max + 1:
        raise SpecterError(f"a synthetic accepted length must be within [1, {n_max + 1}] at a depth of {n_max} "
                           f"drafted tokens, got {synth_len:g}")
    if synth_len in (1, n_max + 1):
        return float(synth_len > 1)
    low, high = 0.0, 1.0
    for _ in range(48):
        mid = (low + high) / 2
        if sum(mid ** j for j in range(1, n_max + 1)) < synth_len - 1:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def synthetic_count(sampler: Sampler, k: int, rate: float) -> int:
    """Drafted tokens a synthetic iteration of depth k keeps: each with probability `rate` once the one before it
    was (draws from the sampler's generator)."""
    n = 0
    while n < k and sampler.random() < rate:
        n += 1
    return n


def synthetic_acceptance(model: Model, synth_len: float | None, n_max: int) -> None:
    """Benchmarks only: make `model`'s speculative decoder keep drafted tokens as llama.cpp's `--spec-synth-len
    synth_len` with `--spec-draft-n-max n_max` does (module docstring), at whatever depth it drafts; None: the
    target's own verdicts again. An auto depth starts its measurements anew: what it learned of the acceptance
    before is not this rate's."""
    from specter_gguf.speculation.decoder import SpeculativeDecoder

    decoder = model.decoder
    if not isinstance(decoder, SpeculativeDecoder):
        raise SpecterError("synthetic acceptance needs a speculative model (a draft)")
    decoder.synth_rate = None if synth_len is None else synthetic_rate(synth_len, n_max)
    if decoder.depth is not None:
        decoder.set_depth("auto")
