"""A forward of a few tokens judged on the device: the unit decoders and speculation are built from.

`Steps` holds the device buffers every step writes: `inputs` [tokens, first position], `choice` [n, the token
after each row] (n: how many of the tokens after the first the step accepts as drafts; 0 for a one-token step),
`next` [the token after the accepted ones, its position] (the next step's inputs) and `finite`. The verdict
writing them is greedy (`judge`: a draft is accepted while it is the argmax of the row before it, each row's
token is its argmax) or speculative sampling (`speculation.accept.SampledVerdict`). A step fed `None` continues
from the previous step's `next`, one fed a device tensor [tokens, position] takes it as it is (a verification's
`next`, drafted tokens): decoding and drafting then chain on the device with no host round trip. `read_choice`
brings `choice` to the host without waiting. `EagerSteps` launches the forward kernel by kernel (the CPU, or
CUDA without graphs); `cuda_graphs.StepGraphs` replays it as a CUDA graph. `PhaseClock` times the decoders' phases
(steps, drafting, verification) on the device.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from specter_gguf.errors import SpecterError
from specter_gguf.layers import ExpertSource, KVCache, RoutingObserver
from specter_gguf.sampling import NONFINITE_LOGITS

if TYPE_CHECKING:
    from specter_gguf.engine import Model

# (logits [T, n_vocab], inputs, choice, next, finite) -> None: writes the step's outputs (module docstring)
Verdict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class Steps:
    """Forwards of `n_tokens` tokens over `cache`, each judged by `verdict` into the device buffers (module
    docstring). `experts`, `observe`: as `Transformer.forward`."""

    def __init__(self, cache: KVCache, n_tokens: int, experts: ExpertSource = None,
                 observe: RoutingObserver | None = None, verdict: Verdict | None = None) -> None:
        self.cache, self.n_tokens, self.experts, self.observe = cache, n_tokens, experts, observe
        self.verdict = judge if verdict is None else verdict
        dev = cache.device
        self.cuda = dev.type == "cuda"
        self.inputs = torch.zeros(n_tokens + 1, dtype=torch.long, device=dev)
        self.next = torch.zeros(2, dtype=torch.long, device=dev)
        self.choice = torch.zeros(n_tokens + 1, dtype=torch.long, device=dev)
        self.finite = torch.ones(1, dtype=torch.bool, device=dev)
        # two host copies of `choice`: a step's copy lands while the host still reads the one of the step before
        self._choices = [torch.zeros(n_tokens + 2, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._chosen = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self._turn = 0
        self.captures = 0  # CUDA graphs captured so far (`StepGraphs`): a step that captures is not a typical one

    def step(self, tokens: list[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_tokens, n_vocab] (float32) of the tokens appended at position `cache.length`; overwritten by
        the next step. `tokens`: host ids, a device tensor [tokens, position] (position `cache.length`), or None:
        the previous step's `next` (a one-token step right after the step that wrote it)."""
        pos = self.cache.length
        self.cache.check_fits(pos + self.n_tokens)
        if tokens is None or isinstance(tokens, torch.Tensor):
            if tokens is None and self.n_tokens != 1:
                raise SpecterError("only a one-token step continues from the previous step's choice")
            self.inputs.copy_(self.next if tokens is None else tokens)
        else:  # from pinned memory without waiting (torch's host allocator keeps it until the copy is done)
            host = torch.tensor([*tokens, pos])
            self.inputs.copy_(host.pin_memory() if self.cuda else host, non_blocking=True)
        logits = self._forward()
        self.cache.length = pos + self.n_tokens
        return logits

    def _forward(self) -> torch.Tensor:
        raise NotImplementedError

    def read_choice(self) -> Callable[[], list[int]]:
        """Enqueue the copy of `choice` to the host without waiting; returns a function that waits for it and
        returns [n, the token after each row]. Call it before the step after next, which reuses its host buffer."""
        host, ready = self._choices[self._turn], self._chosen[self._turn]
        self._turn ^= 1
        host[:-1].copy_(self.choice, non_blocking=True)
        host[-1:].copy_(self.finite, non_blocking=True)
        if ready is not None:
            ready.record()

        def read() -> list[int]:
            if ready is not None:
                ready.synchronize()
            values = host.tolist()
            if not values[-1]:
                raise SpecterError(NONFINITE_LOGITS)
            return values[:-1]

        return read

    def step_ahead(self, token: int | None = None) -> Callable[[], int]:
        """Enqueue a one-token `step(token)` and the copy of the token its verdict chose (the argmax, or a draw) to
        the host, waiting for neither. Returns a function that waits for the copy and returns that token (see
        `read_choice`)."""
        self.step(None if token is None else [token])
        read = self.read_choice()
        return lambda: read()[1]


class EagerSteps(Steps):
    """`Steps` launched kernel by kernel; with `offload`, through `Model.forward` (which brackets an offloaded
    model's runtime), else straight through the transformer."""

    def __init__(self, model: Model, cache: KVCache, n_tokens: int, experts: ExpertSource = None,
                 observe: RoutingObserver | None = None, offload: bool = True, verdict: Verdict | None = None) -> None:
        super().__init__(cache, n_tokens, experts, observe, verdict)
        self.forward = model.forward if offload else model.transformer.forward

    def _forward(self) -> torch.Tensor:
        logits = self.forward(self.inputs[:self.n_tokens], self.cache, experts=self.experts, observe=self.observe)
        self.verdict(logits, self.inputs, self.choice, self.next, self.finite)
        return logits


def judge(logits: torch.Tensor, inputs: torch.Tensor, choice: torch.Tensor, next: torch.Tensor,
          finite: torch.Tensor) -> None:
    """The greedy verdict on a forward's `inputs` [tokens (T), first position] from its `logits` [T, n_vocab], on
    the device, into `choice`, `next` and `finite` (module docstring)."""
    T = logits.shape[0]
    tokens, pos = inputs[:T], inputs[T:]
    best, argmax = torch.max(logits, -1)  # ties: the first index (documented), as in Sampler._argmax
    agree = (argmax[:-1] == tokens[1:]).long().cumprod(0).sum(0, keepdim=True)
    choice.copy_(torch.cat([agree, argmax]))
    next.copy_(torch.cat([argmax.gather(0, agree), pos + agree + 1]))
    finite.copy_(torch.isfinite(best).all().view(1))


def make_steps(model: Model, cache: KVCache, n_tokens: int, experts: ExpertSource = None,
               observe: RoutingObserver | None = None, offload: bool = True, graphs: bool = False,
               verdict: Verdict | None = None) -> Steps:
    """CUDA-graph steps when `graphs` (CUDA), else eager ones. `offload`: the forwards read the model's offloaded
    experts (its runtime brackets them); False for forwards whose routed experts are all resident (the draft).
    `verdict`: `judge` when None."""
    if graphs:
        from specter_gguf.cuda_graphs import StepGraphs

        return StepGraphs(model.transformer, cache, n_tokens, experts, observe, model.offload if offload else None,
                          verdict)
    return EagerSteps(model, cache, n_tokens, experts, observe, offload, verdict)


class PhaseClock:
    """Time per phase of the iterations: CUDA events on the compute stream (GPU time, read once at the end),
    wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str | None, object]] = []

    def mark(self, phase: str | None = None) -> None:
        """The end of `phase` (None: the start of the next one)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((phase, event))
        else:
            self._marks.append((phase, time.perf_counter()))

    def drop_last(self) -> None:
        """Forget the last phase (its two marks)."""
        del self._marks[-2:]

    def last(self, phase: str, back: int = 0) -> float:
        """Seconds of the latest `phase`, or of the one `back` before it (on CUDA its end must have completed: read
        after the iteration's verdict)."""
        for (_, begin), (name, end) in zip(reversed(self._marks[:-1]), reversed(self._marks)):
            if name == phase:
                if not back:
                    return begin.elapsed_time(end) / 1000 if self.cuda else end - begin
                back -= 1
        raise KeyError(phase)

    def total(self, phase: str) -> float:
        """Seconds spent in `phase` (waits for the device on CUDA: call it at the end)."""
        total = 0.0
        for (_, begin), (name, end) in zip(self._marks, self._marks[1:]):
            if name != phase:
                continue
            if self.cuda:
                end.synchronize()
                total += begin.elapsed_time(end) / 1000
            else:
                total += end - begin
        return total
