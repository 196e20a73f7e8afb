"""The speculative decoder: draft, lookahead, verify, accept (see the package docstring), one iteration at a time.

Decoding without penalties runs on the device: the draft's one-token steps feed each other the token they chose
(greedy: their argmax; sampled: a draw from the draft's distribution, which stays on the device for the
acceptance test), the verification's inputs are assembled from the drafted tokens on the device, it judges them
itself (`steps.judge`, `accept.SampledVerdict`) and its verdict feeds the next iteration's first draft step; the
host reads one small tensor per iteration (how many were accepted and the tokens). A sampled iteration's uniforms
are drawn on the host from the sampler's generator and reach the device without a wait. Where `--n-draft auto`
chooses depth 0 (a plain step of the target) the steps run one ahead of the host until it chooses to draft again
(`_plain_run`), as `decoding.StepDecoder` runs plain decoding, and an offloaded target's misses come into its
expert cache as in plain decoding (no lookahead prefetches for them). Decoding with penalties
chooses each drafted token on the host and accepts with `accept.accept_drafts`. The steps are CUDA graphs on the
model's reusable cache when the model replays graphs, eager otherwise (the CPU: the same algorithm, which CI
tests).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Literal

import torch

from specter_gguf.gguf_file import GGUFFile
from specter_gguf.layers import Experts, KVCache, MoE, RoutingObserver
from specter_gguf.sampling import Sampler, SamplingParams, chain_candidates
from specter_gguf.speculation.accept import SampledVerdict, VerdictRows, accept_drafts, synthetic_count
from specter_gguf.speculation.agreement import Observers, RoutingAgreement
from specter_gguf.speculation.depth import MAX_DEPTH, DepthChooser, parse_depth
from specter_gguf.speculation.draft import load_draft_experts
from specter_gguf.speculation.lookahead import ExpertLookahead, after_copies, chunk_ends
from specter_gguf.steps import PhaseClock, Steps, make_steps

if TYPE_CHECKING:
    from specter_gguf.engine import GenerationStats, Model

DEFAULT_N_DRAFT = 4
PCIE_BYTES_PER_S = 25e9  # the copy rate assumed before one is measured (PCIe 4.0 x16)
# how a verification meets the lookahead's copies still in flight (`ExpertLookahead.wait_for_copies`): each MoE
# layer waits for its own ("layer"), all are waited for before it starts ("all"), or it reads those experts in
# place while they land ("none"); the other two are there to be measured against (scripts/bench_prefetch.py)
PREFETCH_WAITS = ("layer", "all", "none")
# the kinds of generation whose depths `--n-draft auto` chooses apart (`SpeculativeDecoder._chooser`)
GENERATION_KINDS = ("greedy", "sampled", "penalties")


class SpeculativeDecoder:
    """Decodes with `n_draft` drafted tokens per verification ("auto": chosen each iteration, `depth`) from the
    draft's `experts`; with an offloaded target, `lookahead` prefetches what the draft routes to. `name`: the
    draft's, for reports."""

    def __init__(self, experts: list[Experts | None], n_draft: int | Literal["auto"],
                 lookahead: ExpertLookahead | None, verify_experts: list[Experts | None] | None = None,
                 name: str = "draft") -> None:
        """`verify_experts`: the target's experts as verifications run them with `prefetch_wait` "layer" (each
        MoE layer waiting for its copies: `lookahead.after_copies`)."""
        self.experts, self.lookahead, self.verify_experts, self.name = experts, lookahead, verify_experts, name
        self.depth: dict[str, DepthChooser] | None = None  # "auto": a chooser per kind of generation (`_chooser`)
        self.set_depth(n_draft)
        self.synth_rate: float | None = None  # benchmarks only (`accept.synthetic_acceptance`)
        self.prefetch_wait = "layer"  # one of PREFETCH_WAITS
        self._steps: dict[tuple, Steps] = {}  # (tokens, experts, observer, top_k or None) -> steps over the cache
        self._cache: KVCache | None = None
        self._step_s = 0.0  # one draft step, measured
        self.agreement: RoutingAgreement | None = None  # made with the first generation, on the model's device
        self._observers: dict[tuple[bool, int], Observers] = {}
        self._rows: dict[int, VerdictRows] = {}  # the verifications' verdict buffers, by candidate count

    @property
    def auto_depth(self) -> bool:
        """Each iteration's depth is chosen (`--n-draft auto`), not fixed."""
        return self.depth is not None

    def set_depth(self, n_draft: int | Literal["auto"]) -> None:
        """Draft `n_draft` tokens per verification from now on, or choose each iteration's depth ("auto")."""
        n_draft = parse_depth(n_draft)
        if n_draft == "auto":
            self.n_draft, self.depth = MAX_DEPTH, {}
        else:
            self.n_draft, self.depth = n_draft, None

    def _chooser(self, params: SamplingParams) -> DepthChooser | None:
        """The depth chooser of generations like `params` (greedy, sampled, or with penalties: drafted on the host),
        None at a fixed depth. Each kind has its own: their verifications cost their own (sampled ones 1.2 ms more
        than greedy ones at depths 1 and 8 on Qwen1.5-MoE shapes, 2026-12-04) and their drafts are kept at their
        own rates, while a caller may alternate them (the benchmark does, generation by generation)."""
        if self.depth is None:
            return None
        kind = "penalties" if params.penalties_active else "greedy" if params.greedy else "sampled"
        if kind not in self.depth:
            self.depth[kind] = DepthChooser(first=DEFAULT_N_DRAFT)
        return self.depth[kind]

    @classmethod
    def load(cls, model: Model, draft: GGUFFile, n_draft: int | Literal["auto"]) -> SpeculativeDecoder:
        """The decoder of `model` with the routed experts of `draft` (a quantized copy of the model's file)."""
        experts = load_draft_experts(draft, model)
        lookahead = verify_experts = None
        if model.offload is not None:
            cfg, cache = model.config, model.offload.cache
            moe_layers = [b.layer for b in model.transformer.blocks if isinstance(b.ffn, MoE)]
            lookahead = ExpertLookahead(cache, cfg.n_layer, cfg.n_expert, moe_layers, model.device)
            verify_experts = after_copies(model.transformer, cache)
        return cls(experts, n_draft, lookahead, verify_experts, draft.path.name)

    # -- steps --------------------------------------------------------------------------------------------
    def steps(self, model: Model, cache: KVCache, n_tokens: int, draft: bool,
              sampled: SamplingParams | None = None) -> Steps:
        """Draft steps (one token, the draft's experts) or verification steps (`n_tokens`, the target's experts —
        waiting for their copies layer by layer with `prefetch_wait` "layer" —, observed by the model's routing
        observer), both recorded by the agreement (`_observer`), judged greedily or,
        with `sampled`, by speculative sampling: CUDA graphs over the model's reusable cache, eager otherwise."""
        if draft:
            experts = self.experts
        else:
            experts = self.verify_experts if self.lookahead is not None and self.prefetch_wait == "layer" else None
        observe = self._observer(model, draft)
        offload = not draft  # the draft's experts are all resident: its steps skip the runtime's bookkeeping
        n_vocab = model.config.n_vocab
        candidates = None if sampled is None else chain_candidates(sampled, n_vocab)

        def verdict() -> SampledVerdict | None:
            if sampled is None:
                return None
            # the verifications of every depth share one set of buffers; a draft step's (copied into the coming
            # verification's after each step) are its own
            rows = None if draft else self._verdict_rows(candidates, n_vocab, model.device)
            return SampledVerdict(sampled, n_tokens, n_vocab, model.device, rows)

        if cache is not model.reusable_cache or not model.cuda_graphs:
            return make_steps(model, cache, n_tokens, experts, observe, offload=offload, verdict=verdict())
        if self._cache is not cache:
            self._steps, self._cache = {}, cache
        key = (n_tokens, id(experts), id(observe), candidates)
        if key not in self._steps:
            self._steps[key] = make_steps(model, cache, n_tokens, experts, observe, offload=offload, graphs=True,
                                          verdict=verdict())
        elif sampled is not None:
            self._steps[key].verdict.set(sampled)
        return self._steps[key]

    def _verdict_rows(self, n_candidates: int, n_vocab: int, device: torch.device) -> VerdictRows:
        """The verifications' shared verdict buffers for `n_candidates` of `n_vocab`, sized for the deepest one."""
        rows = self._rows.get(n_candidates)
        if rows is None or rows.n_tokens < self.n_draft + 1 or rows.n_vocab != n_vocab or rows.device != device:
            rows = self._rows[n_candidates] = VerdictRows(self.n_draft + 1, n_candidates, n_vocab, device)
        return rows

    def _observer(self, model: Model, draft: bool) -> RoutingObserver:
        """Draft steps: the agreement's draft side (whose rows the lookahead buffer counts); verifications: the
        model's routing observer and the agreement's target side. One object per combination: graphs are keyed by
        it."""
        other = None if draft else model.routing_observer
        key = (draft, id(other))  # `other` stays alive in the entry, so its id is not reused
        if key not in self._observers:
            a = self.agreement
            self._observers[key] = Observers(other, a.on_draft if draft else a.on_verify)
        return self._observers[key]

    # -- the iterations -----------------------------------------------------------------------------------
    def tokens(self, model: Model, logits: torch.Tensor, cache: KVCache, sampler: Sampler, history: list[int],
               stats: GenerationStats, n_wanted: int) -> Iterator[int]:
        stats.draft_accepted, stats.iterations = 0, []
        if self.agreement is None or self.agreement.depth < self.n_draft:  # its buffers hold n_draft rows
            self.agreement = RoutingAgreement.of(model.transformer, model.device, self.n_draft)
            self._observers.clear()
            self._steps = {}  # their graphs captured the observers of the agreement replaced
        self.agreement.reset()
        if self.lookahead is not None:
            stats.prefetched = stats.prefetched_used = stats.verify_missing = 0
            stats.prefetch_late = stats.prefetch_refused = 0
        clock = PhaseClock(model.device)
        p = sampler.params
        on_device = not p.penalties_active
        depth = self._chooser(p)
        token = sampler.sample(logits, history)
        start: torch.Tensor | None = None  # the last verification's verdict [token, position], on the device
        n_yielded = 0
        first_iteration = True
        read_at = time.perf_counter()  # the last read of a verdict: an iteration's wall time runs from there
        try:
            while True:
                yield token
                n_yielded += 1
                room = model.ctx_size - cache.length - 1  # positions left after `token`'s
                if room < 0:
                    return
                if room == 0:  # no room to draft: one plain step
                    logits = model.forward(torch.tensor([token], device=model.device), cache)[-1]
                    token, start = sampler.sample(logits, history), None
                    continue
                # an iteration yields its accepted drafts and one token more: none drafted past what is wanted; a
                # generation's first drafts where the experts are offloaded (`DepthChooser.choose`)
                opening = first_iteration and self.lookahead is not None
                k = min(self.n_draft if depth is None else depth.choose(opening), room,
                        max(0, n_wanted - n_yielded - 1))
                if on_device and k == 0 and depth is not None:
                    token, start, n = yield from self._plain_run(model, cache, token if start is None else start,
                                                                 sampler, depth, stats, clock, n_wanted - n_yielded,
                                                                 measure=not first_iteration)
                    n_yielded += n
                    first_iteration = False
                    read_at = time.perf_counter()
                    continue
                pos = cache.length
                captures = self._captures()
                clock.mark()
                if on_device:
                    verify = self.steps(model, cache, k + 1, draft=False, sampled=None if p.greedy else p)
                    drafted = self._draft_on_device(model, cache, token if start is None else start, k, verify,
                                                    sampler)
                else:
                    verify = self.steps(model, cache, k + 1, draft=False)
                    drafted_ids, draft_probs = self._draft_on_host(model, cache, token, k, sampler, history)
                clock.mark("draft")
                if self.lookahead is not None:
                    self.lookahead.plan()
                    if self.prefetch_wait != "none":
                        self.lookahead.wait_for_copies(in_kernels=self.prefetch_wait == "layer")
                cache.truncate(pos)
                if on_device:
                    verify.step(torch.cat([drafted, torch.full((1,), pos, device=drafted.device)]))
                    self.agreement.compare(k)
                    clock.mark("verify")
                    n, *choices = verify.read_choice()()  # the one host read of the iteration
                    if self.synth_rate is not None:
                        n = synthetic_count(sampler, k, self.synth_rate)
                        accepted = drafted[1:n + 1].tolist()
                        token, start = choices[n], None
                    else:
                        accepted, token, start = choices[:n], choices[n], verify.next
                else:
                    verified = verify.step([token, *drafted_ids])
                    self.agreement.compare(k)
                    clock.mark("verify")
                    accepted, token = accept_drafts(verified, drafted_ids, draft_probs, sampler, history,
                                                    self.synth_rate)
                cache.truncate(pos + 1 + len(accepted))
                now = time.perf_counter()
                # the verdict was read: the phases' events have completed. Not measured for the depth: an iteration
                # that captured a CUDA graph (tens of ms, once), and a generation's first, whose verification turns
                # the expert cache over from the prompt's experts to the decoding's (38-54 ms at any depth on the
                # benchmark shape, 4-6x a later one: it kept the depth it was run at from being chosen again)
                draft_s, verify_s = clock.last("draft"), clock.last("verify")
                if depth is not None and self._captures() == captures and not first_iteration:
                    wall = now - read_at  # the caller's time since the last verdict and this iteration's host work
                    depth.record(k, len(accepted), draft_s, verify_s, max(0.0, wall - draft_s - verify_s))
                read_at = now
                self._account(model, stats, k, len(accepted), verify_s)
                first_iteration = False
                for t in accepted:  # counted as handed out: a stop string may end the generation among them
                    stats.draft_accepted += 1
                    yield t
                    n_yielded += 1
        finally:
            stats.draft_s, stats.verify_s = clock.total("draft"), clock.total("verify")
            stats.gpu_s = stats.draft_s + stats.verify_s if clock.cuda else None
            stats.expert_agreement, stats.expert_agreement_layers = self.agreement.read()
            if stats.draft_tokens:
                self._step_s = stats.draft_s / stats.draft_tokens

    def _plain_run(self, model: Model, cache: KVCache, first: int | torch.Tensor, sampler: Sampler,
                   depth: DepthChooser, stats: GenerationStats, clock: PhaseClock, n_left: int,
                   measure: bool) -> Generator[int, None, tuple[int, torch.Tensor, int]]:
        """Depth-0 iterations (a plain step of the target each, from `first`: a host token or the last verdict on
        the device) for as long as `depth` picks depth 0 and `n_left` tokens are wanted, each enqueued before
        the token of the one before it is read, so the host's work between steps (reading a token, choosing the
        next depth, the offload runtime's bookkeeping) overlaps the device's. Yields the tokens of all but the
        last step; returns the last one's token, its verdict on the device (the next iteration's start) and how
        many tokens were yielded. `measure`: whether the first step counts for the chooser (not a generation's
        first iteration)."""
        p = sampler.params
        steps = self.steps(model, cache, 1, draft=False, sampled=None if p.greedy else p)
        offload = model.offload if self.lookahead is not None else None
        misses = 0  # the runtime's count before the run
        if offload is not None:  # one lookahead round for the run, with nothing to copy: the layers' waits pass
            self.lookahead.start()
            self.lookahead.plan()
            if self.prefetch_wait != "none":
                self.lookahead.wait_for_copies(in_kernels=self.prefetch_wait == "layer")
            offload.settle(wait=True)
            misses = offload.counters.cache_misses

        def enqueue(feed: list[int] | torch.Tensor | None) -> tuple[Callable[[], list[int]], bool]:
            """One step; the read of its choice and whether it captured a CUDA graph (not a typical step)."""
            if not p.greedy:
                steps.verdict.take_uniforms(sampler)
            captures = self._captures()
            clock.mark()
            # its misses come into the cache as plain decoding's do: no lookahead prefetches for these steps
            with offload.bringing_in() if offload is not None else contextlib.nullcontext():
                steps.step(feed)
            clock.mark("verify")
            return steps.read_choice(), self._captures() != captures

        pending = enqueue([first] if isinstance(first, int) else first)
        made, read_at = 1, time.perf_counter()
        asked = cache.length  # the cache's length without a step ahead
        try:
            while True:
                ahead = made < n_left and cache.length < model.ctx_size and depth.choose() == 0
                following = enqueue(None) if ahead else None
                token = pending[0]()[1]
                now = time.perf_counter()
                verify_s = clock.last("verify", back=int(ahead))
                if measure and not pending[1]:
                    depth.record(0, 0, 0.0, verify_s, max(0.0, now - read_at - verify_s))
                stats.iterations.append((0, 0, verify_s))
                measure, read_at = True, now
                if following is None:
                    break
                yield token  # the caller may stop here, with the following step enqueued
                asked, pending, made = cache.length, following, made + 1
        finally:
            cache.truncate(asked)
        if offload is not None:
            offload.settle(wait=True)
            stats.verify_missing += offload.counters.cache_misses - misses  # nothing is prefetched at depth 0
        return token, steps.next, made - 1

    def _captures(self) -> int:
        return sum(steps.captures for steps in self._steps.values())

    def _draft_on_device(self, model: Model, cache: KVCache, first: int | torch.Tensor, k: int, verify: Steps,
                         sampler: Sampler) -> torch.Tensor:
        """k draft steps from `first` (a host token, or the last verification's device verdict), each fed the
        previous one's choice on the device; no host synchronisation. Sampled, the steps' uniforms and the
        `verify` steps' ones are drawn first, and each drafted token's distribution goes to `verify`. Returns
        [first token, d_1 .. d_k] on the device."""
        sampled = None if sampler.params.greedy else sampler.params
        steps = self.steps(model, cache, 1, draft=True, sampled=sampled)
        ends = self._chunk_ends(model, k)
        if self.lookahead is not None:
            self.lookahead.start()
        if sampled is not None:
            uniforms = sampler.uniforms(2 * k + 1)  # k draws, then the verification's k tests and one draw
            uniforms = (uniforms.pin_memory() if steps.cuda else uniforms).to(model.device, non_blocking=True)
            verify.verdict.uniforms.copy_(uniforms[k:])
        if k == 0:  # a plain step of the target: nothing drafted
            if not isinstance(first, int):
                return first[:1].clone()
            host = torch.tensor([first])
            return (host.pin_memory() if steps.cuda else host).to(model.device, non_blocking=True)
        out = []
        for j in range(k):
            if sampled is not None:
                steps.verdict.uniforms.copy_(uniforms[j:j + 1])
            steps.step(None if j else [first] if isinstance(first, int) else first)
            self.agreement.drafted(j)
            if not j:
                out.append(steps.inputs[:1].clone())
            out.append(steps.next[:1].clone())
            if sampled is not None:
                verify.verdict.draft_ids[j].copy_(steps.verdict.ids[0])
                verify.verdict.draft_probs[j].copy_(steps.verdict.probs[0])
            if self.lookahead is not None and j + 1 in ends:
                self.lookahead.snapshot(self.agreement.drafted_rows(j + 1))
        return torch.cat(out)

    def _draft_on_host(self, model: Model, cache: KVCache, token: int, k: int, sampler: Sampler,
                       history: list[int]) -> tuple[list[int], list[torch.Tensor] | None]:
        """k drafted tokens chosen on the host (sampling, or greedy with penalties) and, when sampling, the draft
        distributions they were drawn from."""
        steps = self.steps(model, cache, 1, draft=True)
        ends = self._chunk_ends(model, k)
        if self.lookahead is not None:
            self.lookahead.start()
        seen = [*history]
        drafted: list[int] = []
        probs: list[torch.Tensor] | None = None if sampler.params.greedy else []
        for j in range(k):
            logits = steps.step(seen[-1:])[0]
            self.agreement.drafted(j)
            if probs is None:
                drafted.append(sampler.sample(logits, seen))
            else:
                probs.append(sampler.probabilities(logits, seen))
                drafted.append(sampler.draw(probs[-1]))
            seen.append(drafted[-1])
            if self.lookahead is not None and j + 1 in ends:
                self.lookahead.snapshot(self.agreement.drafted_rows(j + 1))
        return drafted, probs

    def _chunk_ends(self, model: Model, k: int) -> list[int]:
        """When the lookahead buffer is read during k drafted tokens (`lookahead.chunk_ends`), from the measured
        draft step and the copy rate the cache has seen."""
        if self.lookahead is None:
            return []
        c = model.offload.counters
        rate = c.bytes_copied / c.copy_s if c.copy_s > 0 else PCIE_BYTES_PER_S
        per_token = model.config.n_expert_used * len(model.offload.layers) * model.offload.plan.slot_bytes
        return chunk_ends(k, self._step_s, 0.25 * per_token / rate)  # about a quarter of them new per token

    def _account(self, model: Model, stats: GenerationStats, k: int, kept: int, verify_s: float) -> None:
        stats.iterations.append((k, kept, verify_s))
        if self.lookahead is None:
            return
        model.offload.settle(wait=True)  # the verification is done (its verdict was read): nothing waits
        used, missed, prefetched = model.offload.last_used, model.offload.last_missed, self.lookahead.prefetched
        prefetched_used = sum(bool(used[key]) for key in prefetched)
        late = sum(bool(missed[key]) for key in prefetched)
        stats.prefetched += len(prefetched)
        stats.prefetched_used += prefetched_used
        stats.prefetch_late += late
        stats.prefetch_refused += self.lookahead.refused
        # what the verification would have missed without the lookahead: its misses and what was prefetched for it
        stats.verify_missing += prefetched_used + int(missed.sum()) - late
