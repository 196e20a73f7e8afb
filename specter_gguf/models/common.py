"""Pieces that several architectures assemble the same way."""

from __future__ import annotations

from typing import Any, Callable

import torch
from tqdm import tqdm

from specter_gguf.config import ModelConfig
from specter_gguf.gguf_file import GGUFFile, block_expert_tensor_name
from specter_gguf.layers import (Attention, Block, Experts, FeedForward, Linear, MoE, Projections, ResidentExperts,
                                  RMSNorm, Router, rope_for)
from specter_gguf.weights import load_tensor


ExpertsFactory = Callable[[ModelConfig, int, "Weights"], Experts]
"""Makes layer i's routed experts; `routed_experts` (all resident on the device) unless the offload runtime
supplies its own (`OffloadRuntime.make_experts`: the host store and the GPU cache). The draft's experts are not
made here: `speculation.draft.load_draft_experts` loads them beside the target's."""


class Weights:
    """Named tensors of the file, validated and loaded onto the device: `w(name, shape)`. `layer(i)` gives
    the same accessor for names relative to block i (`attn_q.weight` -> `blk.i.attn_q.weight`).
    `make_experts` places each layer's routed experts; `shared(key, make)` gives every layer one object
    (the RoPE and its cos/sin tables)."""

    def __init__(self, f: GGUFFile, device: torch.device, bar: tqdm, make_experts: ExpertsFactory | None = None,
                 prefix: str = "", shared: dict[Any, Any] | None = None) -> None:
        self.f, self.device, self.bar, self.prefix = f, device, bar, prefix
        self.make_experts = make_experts or (lambda cfg, i, w: routed_experts(cfg, w))
        self._shared = {} if shared is None else shared

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def __call__(self, name: str, shape: tuple[int, ...], optional: bool = False) -> torch.Tensor | None:
        name = self.prefix + name
        if optional and not self.f.has_tensor(name):
            return None
        t = self.f.tensor(name, shape)
        self.bar.update(t.n_bytes)
        return load_tensor(t, self.device)

    def layer(self, i: int) -> Weights:
        return Weights(self.f, self.device, self.bar, self.make_experts, f"blk.{i}.", self._shared)


def attention(cfg: ModelConfig, w: Weights, neox: bool, qk_norm: str | None = None) -> Attention:
    """GQA attention from attn_{q,k,v,output} (biases optional). `qk_norm`: "head" (one norm per head,
    Qwen3) or "full" (over all heads, OLMoE) from attn_{q,k}_norm."""
    d, nq, nkv = cfg.head_dim, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    norm_q, norm_k = {"head": (d, d), "full": (nq, nkv), None: (0, 0)}[qk_norm]
    return Attention(
        n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=d,
        qkv=Projections.of(Linear(w("attn_q.weight", (nq, cfg.n_embd)), w("attn_q.bias", (nq,), optional=True)),
                           Linear(w("attn_k.weight", (nkv, cfg.n_embd)), w("attn_k.bias", (nkv,), optional=True)),
                           Linear(w("attn_v.weight", (nkv, cfg.n_embd)), w("attn_v.bias", (nkv,), optional=True))),
        wo=Linear(w("attn_output.weight", (cfg.n_embd, nq)), w("attn_output.bias", (cfg.n_embd,), optional=True)),
        rope=w.shared(("rope", neox), lambda: rope_for(cfg, neox)),  # plain Rope unless the file asks for YaRN
        q_norm=RMSNorm(w("attn_q_norm.weight", (norm_q,)), cfg.rms_eps) if qk_norm else None,
        k_norm=RMSNorm(w("attn_k_norm.weight", (norm_k,)), cfg.rms_eps) if qk_norm else None,
    )


def router(cfg: ModelConfig, w: Weights, normalize: bool) -> Router:
    return Router(w("ffn_gate_inp.weight", (cfg.n_expert, cfg.n_embd)), cfg.n_expert_used, normalize,
                  cfg.expert_weights_scale)


def routed_experts(cfg: ModelConfig, w: Weights) -> ResidentExperts:
    e, f, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    name = block_expert_tensor_name
    return ResidentExperts(gate=w(name("gate"), (e, f, d)), up=w(name("up"), (e, f, d)),
                           down=w(name("down"), (e, d, f)))


def norm(cfg: ModelConfig, w: Weights, name: str) -> RMSNorm:
    return RMSNorm(w(f"{name}.weight", (cfg.n_embd,)), cfg.rms_eps)


def moe_block(cfg: ModelConfig, i: int, w: Weights, *, neox: bool,
              normalize_topk: bool, qk_norm: str | None = None, shared: FeedForward | None = None,
              shared_gate: torch.Tensor | None = None) -> Block:
    """The pre-norm block all supported architectures share: attention, then a routed-expert FFN."""
    return Block(
        layer=i,
        attn_norm=norm(cfg, w, "attn_norm"),
        attn=attention(cfg, w, neox=neox, qk_norm=qk_norm),
        ffn_norm=norm(cfg, w, "ffn_norm"),
        ffn=MoE(i, router(cfg, w, normalize_topk), w.make_experts(cfg, i, w), shared, shared_gate),
    )
