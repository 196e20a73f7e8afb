"""Speculative decoding with a quantized draft of the experts (Specter, arXiv 2511.14102).

The draft is not a second model: it is a quantized copy of the target's routed experts (read from a draft GGUF,
e.g. `specter-gguf quantize MODEL.gguf --type q4_k_m`), resident on the device. Drafting runs the target's own
transformer with the draft experts swapped into its MoE layers, so attention, norms, routers, shared experts
and the KV cache are the target's. A round, after the last committed token t (not yet in the cache):

1. draft: k single-token passes with the draft experts, from t, propose d_1 .. d_k;
2. verify: one target pass over [t, d_1 .. d_k] writes the target's keys/values over the draft's and gives
   the target's logits after each of them;
3. accept: greedy keeps d_i while it is the target's own choice; sampled decoding keeps d_i with probability
   min(1, p(d_i) / q(d_i)) and otherwise draws from max(0, p - q) normalized (speculative sampling), where p
   and q are the target's and the draft's distributions after the sampling chain. Either way the output is
   distributed exactly as the target's alone (greedy: the same tokens). The target's logits after the last
   accepted token give one more token; the cache is cut back to the accepted tokens.

Synthetic acceptance (`synth_len` L, for benchmarks only): each round accepts floor(L-1) or ceil(L-1) drafted
tokens whatever the target says, with the mean L - 1, so that the mean accepted length per verification
(the target's token included) is L. The compute and data movement are real, the text is not.

With an offloaded target the draft's routing drives prefetching (`runtime.elb`): after each draft pass the
experts it chose are requested from the target's expert cache, so their copies run during the rest of the
drafting. Drafting and verification run eagerly (no CUDA graphs yet).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from specter_gguf.config import ModelConfig
from specter_gguf.engine import GenerationStats, Model
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.layers import Experts, KVCache, MoE, ResidentExperts
from specter_gguf.runtime.elb import ExpertLookahead
from specter_gguf.sampling import Sampler
from specter_gguf.weights import load_tensor

DEFAULT_N_DRAFT = 4


class SpeculativeModel(Model):
    """A `Model` that decodes speculatively with the experts of a draft GGUF. `generate` and everything built
    on it (chat, the OpenAI-style API, the server) work as for `Model`; `stats` adds the draft figures."""

    draft_experts: list[Experts | None]
    n_draft: int = DEFAULT_N_DRAFT
    synth_len: float | None = None
    lookahead: ExpertLookahead | None = None  # with an offloaded target: the draft's routing prefetches

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, draft: str | os.PathLike[str] | None = None,
             n_draft: int = DEFAULT_N_DRAFT, synth_len: float | None = None, lookahead: bool = True,
             **options: Any) -> SpeculativeModel:
        """`Model.load(path, **options)` plus the routed experts of `draft` (a quantized copy of `path`) on the
        same device; `n_draft` tokens are drafted per round; `synth_len`: synthetic acceptance (see the
        module docstring); `lookahead`: with offloaded experts, prefetch what the draft routes to (the ELB)."""
        if draft is None:
            raise SpecterError("speculative decoding needs a draft GGUF (--draft), e.g. one made by "
                               "`specter-gguf quantize MODEL.gguf --type q4_k_m`")
        if n_draft < 1:
            raise SpecterError(f"--n-draft must be at least 1, got {n_draft}")
        if synth_len is not None and not synth_len >= 1:
            raise SpecterError(f"a synthetic accepted length must be at least 1, got {synth_len}")
        draft_file = GGUFFile(draft)
        model = super().load(path, draft=draft_file, **options)
        assert isinstance(model, SpeculativeModel)
        model.draft_experts = load_draft_experts(draft_file, model)
        model.n_draft = n_draft if synth_len is None else max(n_draft, math.ceil(synth_len - 1))
        model.synth_len = synth_len
        if lookahead and model.offload is not None:
            model.lookahead = ExpertLookahead(model.offload.cache)
        model.cuda_graphs = False
        return model

    def _tokens(self, logits: torch.Tensor, cache: KVCache, graphs: Any, sampler: Sampler, history: list[int],
                stats: GenerationStats) -> Iterator[int]:
        stats.draft_tokens = stats.draft_accepted = stats.draft_rounds = 0
        token = sampler.sample(logits, history)
        while True:
            yield token
            room = self.ctx_size - cache.length - 1  # positions left after `token`'s
            if room < 0:
                return
            if room == 0:  # no room to draft: one plain step
                logits = self.transformer.forward(torch.tensor([token], device=self.device), cache)[-1]
                token = sampler.sample(logits, history)
                continue
            k = min(self.n_draft, room)
            start = cache.length
            drafted, draft_probs = self._draft(k, cache, sampler, history)
            cache.truncate(start)
            verified = self.transformer.forward(torch.tensor([token, *drafted], device=self.device), cache)
            accepted, token = accept_drafts(verified, drafted, draft_probs, sampler, history, self.synth_len)
            cache.truncate(start + 1 + len(accepted))
            stats.draft_tokens += k
            stats.draft_accepted += len(accepted)
            stats.draft_rounds += 1
            for t in accepted:
                yield t

    def _draft(self, k: int, cache: KVCache, sampler: Sampler,
               history: list[int]) -> tuple[list[int], list[torch.Tensor] | None]:
        """k drafted tokens after the last of `history` and, when sampling, the draft distributions they were
        drawn from."""
        seen = [*history]
        drafted: list[int] = []
        probs: list[torch.Tensor] | None = None if sampler.params.greedy else []
        for _ in range(k):
            logits = self.transformer.forward(torch.tensor(seen[-1:], device=self.device), cache,
                                              experts=self.draft_experts, observe=self.lookahead)[-1]
            if probs is None:
                drafted.append(sampler.sample(logits, seen))
            else:
                probs.append(sampler.probabilities(logits, seen))
                drafted.append(sampler.draw(probs[-1]))
            seen.append(drafted[-1])
            if self.lookahead is not None:
                self.lookahead.flush()
        return drafted, probs


def accept_drafts(verified: torch.Tensor, drafted: list[int], draft_probs: list[torch.Tensor] | None,
                  sampler: Sampler, history: list[int], synth_len: float | None = None) -> tuple[list[int], int]:
    """The accepted prefix of `drafted` and the target's token after it, from the target's logits `verified`
    [k+1, n_vocab] after the last token of `history` and after each drafted one. `draft_probs`: the draft
    distributions the tokens were drawn from (None: greedy drafting)."""
    seen = [*history]
    if synth_len is not None:
        extra = synth_len - 1
        n = min(len(drafted), math.floor(extra) + (sampler.random() < extra - math.floor(extra)))
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


def load_draft_experts(draft: GGUFFile, target: Model) -> list[Experts | None]:
    """The routed experts of every MoE layer of `target`, from `draft` (a quantized copy of the target file),
    resident on the target's device; None for layers without routed experts."""
    cfg, dcfg = target.config, ModelConfig.from_gguf(draft)
    same = (dcfg.arch, dcfg.n_layer, dcfg.n_expert, dcfg.n_embd, dcfg.n_ff_exp)
    want = (cfg.arch, cfg.n_layer, cfg.n_expert, cfg.n_embd, cfg.n_ff_exp)
    if same != want:
        raise SpecterError(f"{draft.path}: not a draft of {target.path}: (architecture, layers, experts, hidden, "
                           f"expert width) {same} against {want}; make one with `specter-gguf quantize`")
    e, f, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    experts: list[Experts | None] = []
    for i, block in enumerate(target.transformer.blocks):
        if not isinstance(block.ffn, MoE):
            experts.append(None)
            continue
        w = {name: load_tensor(draft.tensor(f"blk.{i}.ffn_{name}_exps.weight", shape), target.device)
             for name, shape in (("gate", (e, f, d)), ("up", (e, f, d)), ("down", (e, d, f)))}
        experts.append(ResidentExperts(**w))
    return experts
