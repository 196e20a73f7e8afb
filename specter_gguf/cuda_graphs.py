"""The one-token decode step replayed as CUDA graphs.

Eager decoding launches every kernel of every layer from Python (~40 per layer, a few microseconds of host
time each), which costs far more than the GPU work of a small-batch MoE step. A graph replays the whole step
with one launch. Shapes must be static, so attention reads a fixed window of the KV cache (a multiple of
`WINDOW` keys, masked past the token's position) and one graph is captured per window as the sequence grows;
the token and its position live in a device tensor that one copy fills per step.

Every graph also writes the argmax of its logits and the next position into `next`, the inputs of the next
step in greedy decoding: `step()` feeds them on the device and `greedy_step` copies the choice to the host
without waiting, so the host can read a token after the step of that token is enqueued and the GPU computes
while the host handles the token (`Model._lookahead`).

A graph holds raw addresses of what it reads: the KV cache storage and the RoPE tables. When either moves
(the cache grew for a longer prompt), the graphs are dropped and captured again.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from specter_gguf.errors import SpecterError
from specter_gguf.layers import KVCache, Positions, Transformer
from specter_gguf.sampling import NONFINITE_LOGITS


class DecodeGraphs:
    """Decode steps of `transformer` over `cache` (on a CUDA device) as CUDA graphs, captured lazily."""

    WINDOW = 256
    WARMUP_STEPS = 2  # eager runs before a capture (lazy allocations, library handles)

    def __init__(self, transformer: Transformer, cache: KVCache) -> None:
        if cache.device.type != "cuda":
            raise SpecterError("CUDA graphs need a CUDA device")
        self.transformer, self.cache = transformer, cache
        self.inputs = torch.zeros(2, dtype=torch.long, device=cache.device)  # token, position
        self.next = torch.zeros(2, dtype=torch.long, device=cache.device)  # argmax of the logits, position + 1
        self.choice = torch.zeros(2, dtype=torch.float64, device=cache.device)  # its logit, the argmax
        self._host = torch.zeros(2, dtype=torch.long, pin_memory=True)
        self._copied = torch.cuda.Event()
        # two host copies of `choice`: a step's copy lands while the host still reads the one of the step before
        self._choices = [torch.zeros(2, dtype=torch.float64, pin_memory=True) for _ in range(2)]
        self._chosen = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._ropes = list({id(b.attn.rope): b.attn.rope for b in transformer.blocks}.values())
        self._storage: tuple[int, ...] = ()

    def step(self, token: int | None = None) -> torch.Tensor:
        """Logits [n_vocab] (float32) of `token` appended at position `cache.length`; the tensor is
        overwritten by the next step. `None`: the argmax of the previous step's logits, fed on the device (that
        step must be the last to have extended the cache)."""
        cache = self.cache
        pos = cache.length
        cache.check_fits(pos + 1)  # here, not in the graph: its window stops at the context size
        window = min(cache.max_len, -(-(pos + 1) // self.WINDOW) * self.WINDOW)
        if token is None:
            self.inputs.copy_(self.next)
        else:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffer
            self._host[0], self._host[1] = token, pos
            self.inputs.copy_(self._host, non_blocking=True)
            self._copied.record()
        if self._storage_moved() or window not in self._graphs:
            self._capture(window)
        graph, logits = self._graphs[window]
        graph.replay()
        cache.length = pos + 1
        return logits[0]

    def greedy_step(self, token: int | None = None) -> Callable[[], int]:
        """Enqueue `step(token)` and the copy of its argmax to the host, waiting for neither. Returns a function
        that waits for the copy and returns that token; call it before the step after next, which reuses
        its host buffer."""
        self.step(token)
        host, ready = self._choices[self._turn], self._chosen[self._turn]
        self._turn ^= 1
        host.copy_(self.choice, non_blocking=True)
        ready.record()

        def read() -> int:
            ready.synchronize()
            value, chosen = host.tolist()
            if not math.isfinite(value):
                raise SpecterError(NONFINITE_LOGITS)
            return int(chosen)

        return read

    def _body(self, window: int) -> torch.Tensor:
        """One step from `inputs`; writes `next` and `choice` but never `inputs`, so that it can run again
        (warm-up) with the same result."""
        at = Positions.window(self.inputs[1:], window)  # a new Positions: RoPE gathers its rows inside the graph
        logits = self.transformer.run(self.inputs[:1], at, self.cache)
        value, token = torch.max(logits[0], 0)  # ties: the first index (documented), as in Sampler._argmax
        self.next.copy_(torch.stack([token, self.inputs[1] + 1]))
        self.choice.copy_(torch.stack([value.double(), token.double()]))
        return logits

    def _capture(self, window: int) -> None:
        # eager warm-up on a side stream, as torch.cuda.graph asks; it computes the same step the graph then
        # replays (same token, same position), so writing the KV cache twice is harmless. It also grows the
        # cache and the RoPE tables to the window before their addresses are captured.
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_STEPS):
                self._body(window)
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        self._storage_moved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._body(window)
        self._graphs[window] = (graph, logits)

    def _storage_moved(self) -> bool:
        """Drop every graph when the KV cache or a RoPE table has moved since the graphs were captured."""
        storage = (self.cache.k[0].data_ptr(), *(0 if r._cos is None else r._cos.data_ptr() for r in self._ropes))
        if storage == self._storage:
            return False
        self._graphs.clear()
        self._storage = storage
        return True
