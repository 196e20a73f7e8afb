"""The one-token decode step replayed as CUDA graphs.

Eager decoding launches every kernel of every layer from Python (~40 per layer, a few microseconds of host
time each), which costs far more than the GPU work of a small-batch MoE step. A graph replays the whole step
with one launch. Shapes must be static, so attention reads a fixed window of the KV cache (a multiple of
`WINDOW` keys, masked past the token's position) and one graph is captured per window as the sequence grows;
the token and its position live in a device tensor that one host-to-device copy fills per step.

A graph holds raw addresses of what it reads: the KV cache storage and the RoPE tables. When either moves
(the cache grew for a longer prompt), the graphs are dropped and captured again.
"""

from __future__ import annotations

import torch

from specter_gguf.errors import SpecterError
from specter_gguf.layers import KVCache, Positions, Transformer


class DecodeGraphs:
    """Decode steps of `transformer` over `cache` (on a CUDA device) as CUDA graphs, captured lazily."""

    WINDOW = 256
    WARMUP_STEPS = 2  # eager runs before a capture (lazy allocations, library handles)

    def __init__(self, transformer: Transformer, cache: KVCache) -> None:
        if cache.device.type != "cuda":
            raise SpecterError("CUDA graphs need a CUDA device")
        self.transformer, self.cache = transformer, cache
        self.inputs = torch.zeros(2, dtype=torch.long, device=cache.device)  # token, position
        self._host = torch.zeros(2, dtype=torch.long, pin_memory=True)
        self._copied = torch.cuda.Event()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._ropes = list({id(b.attn.rope): b.attn.rope for b in transformer.blocks}.values())
        self._storage: tuple[int, ...] = ()

    def step(self, token: int) -> torch.Tensor:
        """Logits [n_vocab] (float32) of `token` appended at position `cache.length`; the tensor is
        overwritten by the next step."""
        cache = self.cache
        pos = cache.length
        cache.check_fits(pos + 1)  # here, not in the graph: its window stops at the context size
        window = min(cache.max_len, -(-(pos + 1) // self.WINDOW) * self.WINDOW)
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

    def _body(self, window: int) -> torch.Tensor:
        at = Positions.window(self.inputs[1:], window)  # a new Positions: RoPE gathers its rows inside the graph
        return self.transformer.run(self.inputs[:1], at, self.cache)

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
