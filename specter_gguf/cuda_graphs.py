"""Steps (`steps.Steps`) replayed as CUDA graphs.

Eager decoding launches every kernel of every layer from Python (~40 per layer, a few microseconds of host
time each), which costs far more than the GPU work of a small-batch MoE step. A graph replays the whole forward
with one launch. Shapes must be static, so attention reads a fixed window of the KV cache (`WINDOW` keys, then
each window twice the last, up to the context; masked past each token's position) and one graph is captured per
window as the sequence grows: a sequence of n keys captures ~log2(n / WINDOW) + 1 of them (n / WINDOW when the
windows grew by WINDOW keys). The native attention reads no key past the last position, so a longer window costs
it only the launch of splits that have nothing to read; where torch's SDPA attends instead (several queries over up
to `layers._SDPA_MAX_KEYS` keys, head sizes the kernel lacks, deepseek2's latent attention) it computes over the
whole window, at most twice the keys;
the tokens and their first position live in the device tensor `inputs`, and the verdict (`steps.judge`, or
speculative sampling with its uniforms in a device tensor) is part of the graph. An offloaded model's forward
reads its experts through the residency table inside the graph, between the runtime's `begin` and `end`.

A graph holds raw addresses of what it reads: the KV cache storage and the RoPE tables. Both are made for the
whole context (which the memory plan counts) before the first graph over them is captured, so they do not move
under them as the sequence grows (it doubled on demand, and each growth dropped every graph: the draft
step's and each verification depth's were captured again, 50-80 ms each for a Qwen1.5-MoE-shaped verification on the
H200, 2026-12-04); should either move, the graphs are dropped and captured again.

Every graph over one KV cache (plain decoding, draft steps, verifications of each depth, each window) draws its
transient memory from one pool (`_POOLS`), not a pool of its own (by the caching allocator's rules at least a
2 MiB segment each, 20 MiB for a 9-token verification's logits over a 152K vocabulary): the graphs of one
sequence replay one at a time, and a graph's output (its logits) is read before another replays, so their
scratch can overlap. The pool is a `torch.cuda.MemPool` that lives as long as the cache: a bare pool handle dies
with the last graph captured into it, and capturing into it again (after the graphs were dropped) fails an
assertion of PyTorch's allocator. What speculation's graphs hold is counted by the memory plan's speculation line
(`runtime/budget.py`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from specter_gguf.errors import SpecterError
from specter_gguf.layers import ExpertSource, KVCache, Positions, RoutingObserver, Transformer, held_stream
from specter_gguf.steps import Steps, Verdict


_POOLS: weakref.WeakKeyDictionary[KVCache, torch.cuda.MemPool] = weakref.WeakKeyDictionary()  # of a cache's graphs
# PyTorch instantiates graphs with each kernel's priority as captured: captured on a high-priority stream, a graph's
# kernels start ahead of those it put on a lower-priority side stream (`layers.Beside`) where both want the SMs.
_CAPTURE_PRIORITY = -1


class StepGraphs(Steps):
    """`Steps` of `transformer` over `cache` (on a CUDA device) as CUDA graphs, captured lazily per attention
    window. `offload`: the model's `OffloadRuntime` when its experts are offloaded."""

    WINDOW = 256
    WARMUP_STEPS = 2  # eager runs before a capture (lazy allocations, library handles)

    def __init__(self, transformer: Transformer, cache: KVCache, n_tokens: int = 1, experts: ExpertSource = None,
                 observe: RoutingObserver | None = None, offload: Any = None, verdict: Verdict | None = None) -> None:
        if cache.device.type != "cuda":
            raise SpecterError("CUDA graphs need a CUDA device")
        super().__init__(cache, n_tokens, experts, observe, verdict)
        self.transformer, self.offload = transformer, offload
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._ropes = list({id(b.attn.rope): b.attn.rope for b in transformer.blocks}.values())
        # what the graphs will hold the addresses of, whole (module docstring)
        cache.reserve(cache.max_len)
        for rope in self._ropes:
            rope.table(cache.max_len, cache.device, cache.max_len)
        self._storage: tuple[int, ...] = ()
        if offload is not None:
            offload.prepare_graphs()

    def _forward(self) -> torch.Tensor:
        cache = self.cache
        # WINDOW, then doubled until the keys fit; it stops at the context size (`step` checked the tokens fit)
        keys = cache.length + self.n_tokens
        window = min(cache.max_len, self.WINDOW << max(0, -(-keys // self.WINDOW) - 1).bit_length())
        if self._storage_moved() or window not in self._graphs:
            self._capture(window)
        graph, logits = self._graphs[window]
        if self.offload is not None:
            self.offload.begin()
        graph.replay()
        if self.offload is not None:
            self.offload.end()
        return logits

    def _body(self, window: int) -> torch.Tensor:
        """One forward from `inputs`; writes `next`, `choice` and `finite` but never `inputs`, so that it can run
        again (warm-up) with the same result."""
        T = self.n_tokens
        tokens, pos = self.inputs[:T], self.inputs[T:]
        at = Positions.window(pos + torch.arange(T, device=pos.device), window)  # RoPE gathers inside the graph
        logits = self.transformer.run(tokens, at, self.cache, experts=self.experts, observe=self.observe)
        self.verdict(logits, self.inputs, self.choice, self.next, self.finite)
        return logits

    def _capture(self, window: int) -> None:
        # eager warm-up on a side stream, as torch.cuda.graph asks; it computes the same forward the graph then
        # replays (same tokens, same positions), so writing the KV cache twice is harmless. It also grows the
        # cache and the RoPE tables to the window before their addresses are captured. No `end` counts its
        # routing; what it copied into spare slots is adopted.
        dev = self.cache.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_STEPS):
                if self.offload is not None:
                    self.offload.begin()
                self._body(window)
                if self.offload is not None:
                    self.offload.adopt_spares()
        torch.cuda.current_stream(dev).wait_stream(side)
        self._storage_moved()
        graph = torch.cuda.CUDAGraph()
        pool = _POOLS.get(self.cache)
        if pool is None:
            with torch.cuda.device(dev):
                pool = _POOLS[self.cache] = torch.cuda.MemPool()
        with torch.cuda.graph(graph, pool=pool.id, stream=held_stream(dev, _CAPTURE_PRIORITY)):
            logits = self._body(window)
        self._graphs[window] = (graph, logits)
        self.captures += 1

    def _storage_moved(self) -> bool:
        """Drop every graph when the KV cache or a RoPE table has moved since the graphs were captured."""
        storage = (self.cache.k[0].data_ptr(), *(0 if r._cos is None else r._cos.data_ptr() for r in self._ropes))
        if storage == self._storage:
            return False
        self._graphs.clear()
        self._storage = storage
        return True
