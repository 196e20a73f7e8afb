"""The layers every architecture is built from.

Activations (the residual stream, norms, router probabilities, logits) are float32. A matrix product runs in
the weight's dtype on CUDA (fp16/bf16 tensor cores, fp32 accumulation) and in float32 on the CPU.
Every forward takes a batch of T new tokens at positions `pos .. pos+T-1`: T is the prompt in prefill, 1 in
plain decoding, and k+1 when a speculative engine verifies k drafted tokens in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from specter_gguf.config import ModelConfig
from specter_gguf.errors import SpecterError


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float32 out; w is [out, in] as GGUF stores it."""
    dtype = w.dtype if w.is_cuda else torch.float32
    return F.linear(x.to(dtype), w.to(dtype)).float()


@dataclass
class Linear:
    weight: torch.Tensor              # [out, in]
    bias: torch.Tensor | None = None  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight)
        return y if self.bias is None else y + self.bias.float()


@dataclass
class RMSNorm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


@dataclass
class Rope:
    """Rotary position embedding of the first `dim` features of each head. `neox` rotates the pairs
    (i, i + dim/2); otherwise adjacent pairs (2i, 2i+1) as in the original LLaMA ("norm" in llama.cpp)."""

    dim: int
    base: float
    neox: bool
    freq_scale: float = 1.0

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]
        inv_freq = self.base ** (-torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim)
        angles = (positions.double()[:, None] * self.freq_scale) * inv_freq[None, :]  # [T, dim/2]
        cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
        rot, rest = x[..., :self.dim].float(), x[..., self.dim:]
        if self.neox:
            a, b = rot[..., :self.dim // 2], rot[..., self.dim // 2:]
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest.float()], dim=-1)


class KVCache:
    """Keys and values of every layer for the tokens seen so far, shared by whoever extends the sequence.
    `length` counts committed tokens; `truncate` rolls back (rejected speculative tokens). Storage grows on
    demand up to `max_len` so a long context costs memory only when used."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, max_len: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.max_len, self.device, self.dtype = max_len, device, dtype
        self.shape = (n_head_kv, 0, head_dim)
        self.k: list[torch.Tensor] = [torch.empty(self.shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v: list[torch.Tensor] = [torch.empty(self.shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.length = 0

    def _grow(self, needed: int) -> None:
        capacity = min(self.max_len, max(needed, 2 * self.k[0].shape[1], 256))
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = torch.empty((old.shape[0], capacity, old.shape[2]), device=self.device, dtype=self.dtype)
                new[:, :old.shape[1]] = old
                store[i] = new

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([T, heads, head_dim]) at positions pos.. and return all keys/values up to pos+T."""
        end = pos + k.shape[0]
        if end > self.max_len:
            raise SpecterError(f"context full: {end} tokens exceed the context size {self.max_len}; "
                               f"raise it with -c/--ctx-size")
        if end > self.k[layer].shape[1]:
            self._grow(end)
        self.k[layer][:, pos:end] = k.transpose(0, 1).to(self.dtype)
        self.v[layer][:, pos:end] = v.transpose(0, 1).to(self.dtype)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@dataclass
class Attention:
    """Grouped-query attention; optional RMSNorm of q and k, either per head (weight of head_dim) or over
    all heads at once (weight of heads*head_dim), as the weight's size says."""

    n_head: int
    n_head_kv: int
    head_dim: int
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    rope: Rope
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def __call__(self, x: torch.Tensor, layer: int, pos: int, cache: KVCache) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None:
            q = self.q_norm(q.view(T, -1, self.q_norm.weight.numel())).view(T, -1)
            k = self.k_norm(k.view(T, -1, self.k_norm.weight.numel())).view(T, -1)
        positions = torch.arange(pos, pos + T, device=x.device)
        q = self.rope(q.view(T, self.n_head, self.head_dim), positions)
        k = self.rope(k.view(T, self.n_head_kv, self.head_dim), positions)
        keys, values = cache.update(layer, pos, k, v.view(T, self.n_head_kv, self.head_dim))
        group = self.n_head // self.n_head_kv
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        # query i (at position pos+i) sees keys 0 .. pos+i
        mask = torch.arange(pos + T, device=x.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1).to(keys.dtype)[None], keys[None], values[None],
                                             attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.wo(out[0].transpose(0, 1).reshape(T, -1))


@dataclass
class FeedForward:
    """SwiGLU feed-forward: down(silu(gate x) * up x)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(F.silu(matmul(x, self.gate)) * matmul(x, self.up), self.down)


@dataclass
class Router:
    """Chooses `n_used` experts per token. llama.cpp semantics: softmax over all experts, top-k of the
    probabilities; optionally renormalized to sum 1, then scaled."""

    weight: torch.Tensor  # [n_expert, n_embd]
    n_used: int
    normalize: bool
    scale: float = 0.0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(matmul(x, self.weight), dim=-1)
        weights, ids = torch.topk(probs, self.n_used, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return ids, weights


class Experts(Protocol):
    """Where a layer's routed experts live and how they run. `ResidentExperts` holds them all on the compute
    device; the offload runtime and the quantized draft provide other implementations."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ResidentExperts:
    """All routed experts of one layer as [n_expert, out, in] tensors. Tokens are grouped by expert so each
    selected expert runs one GEMM over all tokens that chose it (the shape of speculative verification)."""

    gate: torch.Tensor  # [E, n_ff_exp, n_embd]
    up: torch.Tensor    # [E, n_ff_exp, n_embd]
    down: torch.Tensor  # [E, n_embd, n_ff_exp]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate.shape[0]).tolist()  # the one host sync of the layer
        out = torch.zeros_like(x, dtype=torch.float32)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // ids.shape[1]
            y = FeedForward(self.gate[expert], self.up[expert], self.down[expert])(x[tokens])
            out.index_add_(0, tokens, y * weights.flatten()[slots, None])
        return out


RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor], None]
"""Called by each MoE layer with (layer index, expert ids [T, k], weights [T, k]); tensors stay on the
compute device, so an observer that does not read them back causes no host synchronisation."""


@dataclass
class MoE:
    layer: int
    router: Router
    experts: Experts
    observers: list[RoutingObserver]
    shared: FeedForward | None = None
    shared_gate: torch.Tensor | None = None  # [1, n_embd]: sigmoid gate of the shared expert (qwen2moe)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        for observe in self.observers:
            observe(self.layer, ids, weights)
        out = self.experts(x, ids, weights)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(matmul(x, self.shared_gate))
            out = out + shared
        return out


@dataclass
class Block:
    layer: int
    attn_norm: RMSNorm
    attn: Attention
    ffn_norm: RMSNorm
    ffn: MoE | FeedForward

    def __call__(self, x: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), self.layer, pos, cache)
        return h + self.ffn(self.ffn_norm(h))


@dataclass
class Transformer:
    config: ModelConfig
    token_embd: torch.Tensor  # [n_vocab, n_embd]
    blocks: list[Block]
    output_norm: RMSNorm
    output: Linear
    observers: list[RoutingObserver] = field(default_factory=list)  # shared with every MoE layer

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [T, n_vocab] (float32) for `tokens` [T] appended at position `cache.length`."""
        pos = cache.length
        x = self.token_embd[tokens].float()
        for block in self.blocks:
            x = block(x, pos, cache)
        cache.length = pos + tokens.shape[0]
        return self.output(self.output_norm(x))

    def new_cache(self, max_len: int) -> KVCache:
        c = self.config
        device = self.token_embd.device
        return KVCache(c.n_layer, c.n_head_kv, c.head_dim, max_len, device,
                       torch.float16 if device.type == "cuda" else torch.float32)
