"""A trainable qwen2moe in PyTorch whose parameters are the GGUF tensors themselves (`TinyMoE`), for the small
trained model (`scripts/train_tiny_moe.py`, `training`).

Each parameter is named and shaped as its GGUF tensor (`architectures.tensor_specs`, numpy order), so export is
writing them (`gguf_weights` into `writer.write_synthetic`). The forward computes what `models/qwen2moe.py` and
`layers.py` (and llama.cpp) compute from the file: RMS norms (eps from the shape), q/k/v with biases, NeoX RoPE over
the whole head, grouped-query causal attention scaled by 1/sqrt(head_dim), a softmax router whose top-k
probabilities weight the experts without renormalisation, SwiGLU experts, a shared SwiGLU expert behind a sigmoid
gate, the final norm and an untied LM head. The routed experts are computed densely (every expert on every token,
weighted by the top-k weights, zeros elsewhere): the same sum as a sparse dispatch, deterministic and simple; at
this size the extra work is small.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import block_expert_tensor_name
from specter_gguf.synthetic.architectures import tensor_specs
from specter_gguf.synthetic.shapes import ModelShape

TINY_MOE = ModelShape(arch="qwen2moe", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
                      n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, n_ctx=512, rope_theta=10000.0, rms_eps=1e-6,
                      name="tiny-qwen2moe-stdlib")
"""The trained model's shape: every weight's input dimension is 256 (K-quant drafts are real K-quants), 8.9 M
parameters at a 3072-token vocabulary (17.9 MB in F16)."""


def check_shape(shape: ModelShape) -> None:
    """Refuse a shape `TinyMoE` does not train (another architecture, input widths K-quants cannot take)."""
    if shape.arch != "qwen2moe" or shape.n_ff_shexp <= 0:
        raise SpecterError(f"TinyMoE trains qwen2moe with a shared expert, not {shape.arch} "
                           f"(n_ff_shexp {shape.n_ff_shexp})")
    widths = {"n_embd": shape.n_embd, "n_ff_exp": shape.n_ff_exp, "n_ff_shexp": shape.n_ff_shexp,
              "n_head * head_dim": shape.n_embd_q}
    bad = {k: v for k, v in widths.items() if v % 256}
    if bad:
        raise SpecterError(f"input widths {bad} are not multiples of 256: K-quant drafts would fall back to "
                           f"other types; choose multiples of 256")
    if shape.n_head % shape.n_head_kv or shape.head_dim % 2:
        raise SpecterError("n_head must be a multiple of n_head_kv and head_dim even")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w.to(x.dtype)


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class TinyMoE(nn.Module):
    """qwen2moe of `shape` with an `n_vocab` vocabulary; parameters by GGUF name (`param(name)`)."""

    def __init__(self, shape: ModelShape, n_vocab: int, seed: int = 0) -> None:
        super().__init__()
        check_shape(shape)
        self.shape, self.n_vocab = shape, n_vocab
        self.specs = tensor_specs(shape, n_vocab)
        self.params = nn.ParameterDict()
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * shape.n_layer)  # outputs into the residual stream (GPT-2's scaling)
        for spec in self.specs:
            t = torch.randn(spec.numpy_shape, generator=g) * 0.02
            if spec.init == "norm":
                t = torch.ones(spec.numpy_shape)
            elif spec.init == "bias":
                t = torch.zeros(spec.numpy_shape)
            elif spec.name.endswith(("attn_output.weight", "_shexp.weight", block_expert_tensor_name("down"))):
                t *= residual_std / 0.02
            self.params[self._key(spec.name)] = nn.Parameter(t)
        rot = torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim
        self.register_buffer("inv_freq", shape.rope_theta ** -rot, persistent=False)

    @staticmethod
    def _key(name: str) -> str:
        return name.replace(".", "/")

    def param(self, name: str) -> torch.Tensor:
        return self.params[self._key(name)]

    def gguf_weights(self) -> dict[str, np.ndarray]:
        """Every tensor by GGUF name, float32 in numpy order (what `write_synthetic(weights=...)` takes)."""
        return {s.name: self.param(s.name).detach().float().cpu().numpy() for s in self.specs}

    def no_decay(self, name: str) -> bool:
        """Norm weights, biases and the shared expert's gate vector: 1-D tensors, kept out of weight decay."""
        return self.params[name].ndim < 2

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """NeoX rotation of x [B, H, T, d]: pairs (i, i + d/2), angle position * theta^(-2i/d) (float64)."""
        T = x.shape[2]
        angles = torch.arange(T, dtype=torch.float64, device=x.device)[:, None] * self.inv_freq.to(x.device)[None]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        s, p = self.shape, f"blk.{i}."
        B, T, _ = x.shape
        q = F.linear(x, self.param(p + "attn_q.weight"), self.param(p + "attn_q.bias"))
        k = F.linear(x, self.param(p + "attn_k.weight"), self.param(p + "attn_k.bias"))
        v = F.linear(x, self.param(p + "attn_v.weight"), self.param(p + "attn_v.bias"))
        q = self._rope(q.view(B, T, s.n_head, s.head_dim).transpose(1, 2))
        k = self._rope(k.view(B, T, s.n_head_kv, s.head_dim).transpose(1, 2))
        v = v.view(B, T, s.n_head_kv, s.head_dim).transpose(1, 2)
        group = s.n_head // s.n_head_kv  # query head h reads key/value head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(s.head_dim))
        return F.linear(out.transpose(1, 2).reshape(B, T, -1), self.param(p + "attn_output.weight"))

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's router on x [N, d]: probabilities [N, E] (float32, also under autocast, as the file's F32
        router computes them), the top-k ids and weights [N, k]."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.param(f"blk.{i}.ffn_gate_inp.weight").float())
        probs = torch.softmax(logits, dim=-1)
        weights, ids = probs.topk(self.shape.n_expert_used, dim=-1)
        return probs, ids, weights

    def _moe(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's FFN on x [N, d] and its load-balancing loss (Switch Transformer's: E * sum_e f_e P_e)."""
        p, E = f"blk.{i}.", self.shape.n_expert
        probs, ids, weights = self.route(i, x)
        combine = torch.zeros_like(probs).scatter(1, ids, weights).to(x.dtype)  # [N, E]
        name = block_expert_tensor_name
        gate, up, down = (self.param(p + name(n)).to(x.dtype) for n in ("gate", "up", "down"))
        act = F.silu(torch.einsum("nd,efd->enf", x, gate)) * torch.einsum("nd,efd->enf", x, up)
        routed = torch.einsum("ne,end->nd", combine, torch.einsum("enf,edf->end", act, down))
        shared = _swiglu(x, self.param(p + "ffn_gate_shexp.weight"), self.param(p + "ffn_up_shexp.weight"),
                         self.param(p + "ffn_down_shexp.weight"))
        with torch.autocast(x.device.type, enabled=False):  # F32 in the file, like the router
            shared_gate = torch.sigmoid(x.float() @ self.param(p + "ffn_gate_inp_shexp.weight").float())[:, None]
        chosen = torch.zeros_like(probs).scatter(1, ids, 1.0).mean(0)  # f_e (times k)
        balance = E * (chosen * probs.mean(0)).sum() / self.shape.n_expert_used
        return routed + shared * shared_gate.to(x.dtype), balance

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, n_vocab] (float32) of tokens [B, T] from position 0, and the mean load-balancing loss."""
        s = self.shape
        B, T = tokens.shape
        x = F.embedding(tokens, self.param("token_embd.weight"))
        balance = x.new_zeros((), dtype=torch.float32)
        for i in range(s.n_layer):
            p = f"blk.{i}."
            x = x + self._attention(i, _rms(x, self.param(p + "attn_norm.weight"), s.rms_eps))
            ffn, b = self._moe(i, _rms(x, self.param(p + "ffn_norm.weight"), s.rms_eps).reshape(B * T, -1))
            x, balance = x + ffn.view(B, T, -1), balance + b
        x = _rms(x, self.param("output_norm.weight"), s.rms_eps)
        return F.linear(x, self.param("output.weight")).float(), balance / s.n_layer

    def rounded_to_f16(self) -> TinyMoE:
        """A float32 copy whose matrices hold the values an F16 export stores (1-D tensors and routers stay F32,
        as the writer keeps them): the model the exported file computes."""
        copy = TinyMoE(self.shape, self.n_vocab)
        with torch.no_grad():
            for spec in self.specs:
                t = self.param(spec.name).detach().float().cpu()
                copy.param(spec.name).copy_(t if spec.f32 else t.half().float())
        return copy
