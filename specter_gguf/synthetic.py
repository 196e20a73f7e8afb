"""Random-weight MoE models written as GGUF files in llama.cpp's exact tensor layout and metadata.

A model is described by a :class:`ModelShape` (named presets in :data:`PRESETS`). Each architecture
(qwen2moe, qwen3moe, llama/Mixtral, olmoe, deepseek2 with MLA, phimoe) contributes small functions to
:data:`ARCHS`: one that lists a block's tensors (name, ggml shape, how to initialise it), one that writes the
architecture's metadata keys and, where the architecture has them, one that lists file-level tensors beyond the
embedding, final norm and LM head (phimoe's biases and rope factors). Another architecture is one more
:class:`ArchSpec` entry (plus any new ``ModelShape`` fields).

Weights (deterministic from ``seed``; each tensor, and each slab of a large tensor, has its own seed derived
from ``(seed, arch, name, slab)``, so a tensor's values do not depend on which other tensors exist —
changing ``n_layer`` keeps the shared layers identical. Values differ between ``device="cpu"`` and ``"cuda"``
because torch's generators differ):

- matrices (attention, experts, shared expert, embeddings): normal, std ``init_std`` (0.02, like the
  HF initialisers of these models);
- the LM head ``output``: normal, std ``logit_std / sqrt(n_embd)`` so that logits of the final (unit-RMS)
  hidden state have std ~``logit_std`` (2.0) at every width — a peaked, non-uniform next-token
  distribution, which makes greedy decoding less fragile than std 0.02 would at small widths;
- routers ``ffn_gate_inp``: normal, std ``router_logit_std / sqrt(n_embd)`` (router logits std ~1.5), so
  the softmax over experts is far from uniform and top-k choices have real margins;
- RMS norm weights: ``1 + N(0, norm_noise)`` with ``norm_noise`` 0.1 — close to 1 like a trained model's,
  but varied enough that an engine forgetting to multiply by a norm weight fails a parity test;
- biases (qwen2moe q/k/v): normal, std ``init_std``.

1-D tensors (norms, biases, ``ffn_gate_inp_shexp``) and routers are F32, as llama.cpp's converter writes
them; other matrices use the requested type (``f32``, ``f16``, ``bf16`` or ``q8_0``).

``q8_0`` writes the target directly in Q8_0 (LLAMA_FTYPE_MOSTLY_Q8_0): every matrix (2-D or 3-D tensor:
embeddings, attention, experts, shared experts, LM head) is quantized slab by slab as it is generated, so no
F16 copy ever exists (a Qwen3-30B-A3B-shaped file is ~32 GB instead of 61 GB). Routers and 1-D tensors stay
F32 as above; a matrix whose row length (``ne0``) is not a multiple of 32 (Q8_0's block) is written as F16
(as llama.cpp's converter falls back; none of the presets has one). The blocks are bit for bit what
``gguf.quants.quantize(x, Q8_0)`` (= ggml's ``quantize_row_q8_0_ref``) gives for the same float32 values:
:func:`q8_0_blocks` does the same arithmetic vectorized in torch, on the generating device (measured on the
16-core H200 machine: 850 M values/s on the CPU, 7x gguf's 125; writing the whole Qwen3-30B-A3B shape in
Q8_0 with ``device="cuda"`` takes 40 s, 775 M params/s; on the CPU generation is bound by torch.randn, ~120 M/s).

Tokenizer: the tiny models carry a small byte-level BPE (GPT-2 byte-to-unicode alphabet, ``pre = qwen2``)
trained by :func:`train_bpe` on ``models/tokenizer-corpus.txt``; real-shape models can copy every
``tokenizer.*`` key from a vocab GGUF (``vocab_from``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .chat import CHATML_TEMPLATE
from .errors import SpecterError

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
CORPUS_PATH = MODELS_DIR / "tokenizer-corpus.txt"

DTYPES = ("f32", "f16", "bf16", "q8_0")
# llama_ftype values (llama.h) recorded in general.file_type.
_FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}
Q8_0_BLOCK = 32  # values per Q8_0 block; a block is one f16 scale + 32 int8 (34 bytes)
_Q8_0_CHUNK_BLOCKS = 1 << 17  # blocks quantized at once on the CPU (4 M values, 16 MB: stays in cache)

# Elements generated at once for large tensors (slabs along the outermost numpy dimension).
_SLAB_ELEMS = 1 << 26


# --------------------------------------------------------------------------------------------------
# Model shapes and presets
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters of a MoE model, in llama.cpp's terms (widths are per expert / per head)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0  # shared-expert width (qwen2moe); 0 = none
    n_ff: int = 0  # `feed_forward_length` to record; 0 = n_ff_exp (the dense width the HF config names)
    n_ctx: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    n_vocab_hint: int = 0  # the HF vocab size, informational; the file's n_vocab is the tokenizer's
    name: str = ""
    # initialisation (see the module docstring)
    init_std: float = 0.02
    norm_noise: float = 0.1
    router_logit_std: float = 1.5
    logit_std: float = 2.0
    # deepseek2 / phimoe (issue 6); defaults leave the other architectures unchanged
    n_leading_dense: int = 0      # first layers with a dense FFN of width n_ff
    n_expert_shared: int = 0      # deepseek2: shared experts, one FFN of n_ff_exp * count
    q_lora_rank: int = 0          # deepseek2: 0 = attn_q directly (V2-Lite)
    kv_lora_rank: int = 0         # deepseek2: the cached latent's width
    qk_rope_dim: int = 0          # deepseek2: rotated dims per head (head_dim = qk_nope + qk_rope)
    v_head_dim: int = 0           # deepseek2
    mla_legacy: bool = False      # deepseek2: write the legacy unsplit attn_kv_b instead of attn_k_b/attn_v_b
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating_func: int = 0   # 0: not written (softmax); 1 softmax; 2 sigmoid
    n_expert_groups: int = 0
    n_group_used: int = 0
    exp_probs_b: bool = False     # selection bias per expert (DeepSeek-V3 style)
    rope_scaling: str = ""        # "yarn" (deepseek2) | "longrope" (phimoe)
    rope_scaling_factor: float = 0.0
    rope_orig_ctx: int = 0
    yarn_mscale_all_dim: float = 0.0

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    def with_layers(self, n_layer: int) -> "ModelShape":
        # keep at least one MoE layer: a 1-layer DeepSeek-V2-Lite is one MoE layer, not its dense layer 0
        return dataclasses.replace(self, n_layer=n_layer,
                                   n_leading_dense=min(self.n_leading_dense, max(n_layer - 1, 0)))


def _tiny(arch: str, **kw: Any) -> ModelShape:
    base: dict[str, Any] = dict(
        arch=arch, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
        n_expert_used=2, n_ff_exp=256, n_ctx=2048, rope_theta=10000.0, rms_eps=1e-6,
    )
    base.update(kw)
    return ModelShape(**base)


PRESETS: dict[str, ModelShape] = {
    # Tiny models: every weight's input dimension is a multiple of 256, so llama.cpp's K-quants apply.
    "tiny-qwen2moe": _tiny("qwen2moe", n_layer=2, n_expert_used=4, n_ff_shexp=512, n_ff=512,
                           rope_theta=1e6, name="tiny-qwen2moe"),
    "tiny-qwen3moe": _tiny("qwen3moe", n_layer=3, n_ff=512, rope_theta=1e6, name="tiny-qwen3moe"),
    # like Qwen3-30B-A3B, n_head * head_dim (512) != n_embd (256): exercises attention.key_length
    "tiny-qwen3moe-hd128": _tiny("qwen3moe", n_layer=2, head_dim=128, n_ff=512, rope_theta=1e6,
                                 name="tiny-qwen3moe-hd128"),
    "tiny-mixtral": _tiny("llama", n_layer=2, rms_eps=1e-5, rope_theta=1e6, name="tiny-mixtral"),
    # llama.cpp's olmoe k-norm has n_embd weights, so it needs n_head_kv == n_head (as OLMoE has).
    "tiny-olmoe": _tiny("olmoe", n_layer=2, n_head_kv=4, rms_eps=1e-5, name="tiny-olmoe"),
    # deepseek2 (MLA). head_dim = qk_nope + qk_rope; YaRN as DeepSeek-V2 (factor 40 from 4096, mscale 0.707).
    # qk_nope is 256 (V2: 128) so attn_k_b's input is K-quant friendly too: no fallback types (Q5_0) anywhere.
    # V2 style: q_lora_rank, a dense first layer, group-limited softmax routing, scaled weights.
    "tiny-deepseek2": _tiny("deepseek2", n_layer=3, n_head_kv=4, head_dim=320, qk_rope_dim=64, v_head_dim=128,
                            q_lora_rank=256, kv_lora_rank=256, n_ff=512, n_leading_dense=1, n_expert_shared=1,
                            n_expert_groups=4, n_group_used=2, expert_weights_scale=2.5, n_ctx=163840,
                            rope_scaling="yarn", rope_scaling_factor=40.0, rope_orig_ctx=4096,
                            yarn_mscale_all_dim=0.707, name="tiny-deepseek2"),
    # V2-Lite style: no q_lora_rank, plain softmax top-k, two shared experts
    "tiny-deepseek2-lite": _tiny("deepseek2", n_layer=2, n_head_kv=4, head_dim=320, qk_rope_dim=64,
                                 v_head_dim=128, kv_lora_rank=256, n_ff=512, n_leading_dense=1, n_expert_used=3,
                                 n_expert_shared=2, expert_weights_scale=1.0, n_ctx=163840, rope_scaling="yarn",
                                 rope_scaling_factor=40.0, rope_orig_ctx=4096, yarn_mscale_all_dim=0.707,
                                 name="tiny-deepseek2-lite"),
    # V3 style gating on the deepseek2 graph: sigmoid + selection bias, groups, renormalized and scaled
    "tiny-deepseek2-sigmoid": _tiny("deepseek2", n_layer=2, n_head_kv=4, head_dim=320, qk_rope_dim=64,
                                    v_head_dim=128, q_lora_rank=256, kv_lora_rank=256, n_ff=512,
                                    n_leading_dense=1, n_expert_shared=1, expert_gating_func=2, exp_probs_b=True,
                                    expert_weights_norm=True, n_expert_groups=4, n_group_used=2,
                                    expert_weights_scale=2.5, n_ctx=163840, rope_scaling="yarn",
                                    rope_scaling_factor=40.0, rope_orig_ctx=4096, yarn_mscale_all_dim=1.0,
                                    name="tiny-deepseek2-sigmoid"),
    # the legacy layout (unsplit attn_kv_b, decompressed head sizes in the metadata)
    "tiny-deepseek2-kvb": _tiny("deepseek2", n_layer=2, n_head_kv=4, head_dim=320, qk_rope_dim=64,
                                v_head_dim=128, kv_lora_rank=256, q_lora_rank=256, n_ff=512, n_leading_dense=1,
                                n_expert_shared=1, mla_legacy=True, n_ctx=163840, rope_scaling="yarn",
                                rope_scaling_factor=40.0, rope_orig_ctx=4096, yarn_mscale_all_dim=0.707,
                                name="tiny-deepseek2-kvb"),
    # phimoe: biases everywhere, longrope factors (long ones used when the context exceeds 256)
    "tiny-phimoe": _tiny("phimoe", n_layer=2, rms_eps=1e-5, n_ctx=4096, rope_scaling="longrope",
                         rope_orig_ctx=256, name="tiny-phimoe"),
    # Real shapes (HF configs). n_vocab_hint is the HF embedding size; the file takes the vocab GGUF's.
    "qwen1.5-moe-a2.7b": ModelShape(
        arch="qwen2moe", n_layer=24, n_embd=2048, n_head=16, n_head_kv=16, head_dim=128, n_expert=60,
        n_expert_used=4, n_ff_exp=1408, n_ff_shexp=5632, n_ff=5632, n_ctx=8192, rope_theta=1e6,
        rms_eps=1e-6, n_vocab_hint=151936, name="Qwen1.5-MoE-A2.7B (random weights)"),
    "qwen3-30b-a3b": ModelShape(
        arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128,
        n_expert_used=8, n_ff_exp=768, n_ff=6144, n_ctx=40960, rope_theta=1e6, rms_eps=1e-6,
        n_vocab_hint=151936, name="Qwen3-30B-A3B (random weights)"),
    "mixtral-8x7b": ModelShape(
        arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_expert=8,
        n_expert_used=2, n_ff_exp=14336, n_ctx=32768, rope_theta=1e6, rms_eps=1e-5,
        n_vocab_hint=32000, name="Mixtral-8x7B (random weights)"),
    "olmoe-1b-7b": ModelShape(
        arch="olmoe", n_layer=16, n_embd=2048, n_head=16, n_head_kv=16, head_dim=128, n_expert=64,
        n_expert_used=8, n_ff_exp=1024, n_ctx=4096, rope_theta=10000.0, rms_eps=1e-5,
        n_vocab_hint=50304, name="OLMoE-1B-7B (random weights)"),
    "deepseek-v2-lite": ModelShape(
        arch="deepseek2", n_layer=27, n_embd=2048, n_head=16, n_head_kv=16, head_dim=192, qk_rope_dim=64,
        v_head_dim=128, kv_lora_rank=512, q_lora_rank=0, n_expert=64, n_expert_used=6, n_ff_exp=1408,
        n_expert_shared=2, n_ff=10944, n_leading_dense=1, expert_weights_scale=1.0, n_ctx=163840,
        rope_theta=10000.0, rms_eps=1e-6, rope_scaling="yarn", rope_scaling_factor=40.0, rope_orig_ctx=4096,
        yarn_mscale_all_dim=0.707, n_vocab_hint=102400, name="DeepSeek-V2-Lite (random weights)"),
    "phi-3.5-moe": ModelShape(
        arch="phimoe", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_expert=16,
        n_expert_used=2, n_ff_exp=6400, n_ctx=131072, rope_theta=10000.0, rms_eps=1e-5, rope_scaling="longrope",
        rope_orig_ctx=4096, n_vocab_hint=32064, name="Phi-3.5-MoE (random weights)"),
}

TINY_PRESETS = ("tiny-qwen2moe", "tiny-qwen3moe", "tiny-mixtral", "tiny-olmoe")
# general.architecture -> the tiny preset tests use for it
TINY_ARCH_PRESETS = {"qwen2moe": "tiny-qwen2moe", "qwen3moe": "tiny-qwen3moe", "llama": "tiny-mixtral",
                     "olmoe": "tiny-olmoe"}

# A vocab GGUF from llama.cpp's source tree that suits each real-shape preset (`--vocab-from`).
SUGGESTED_VOCAB = {
    "qwen1.5-moe-a2.7b": "ggml-vocab-qwen2.gguf",
    "qwen3-30b-a3b": "ggml-vocab-qwen2.gguf",
    "mixtral-8x7b": "ggml-vocab-llama-spm.gguf",
    "olmoe-1b-7b": "ggml-vocab-gpt-neox.gguf",
    "deepseek-v2-lite": "ggml-vocab-deepseek-llm.gguf",
    "phi-3.5-moe": "ggml-vocab-phi-3.gguf",
}


def get_preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecterError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


# --------------------------------------------------------------------------------------------------
# Tensor lists per architecture
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: GGUF name, shape in ggml order (ne0 first), and how to initialise it."""

    name: str
    ne: tuple[int, ...]
    init: str  # "normal" | "norm" | "router" | "output" | "bias"
    f32: bool = False  # always stored as F32 (1-D tensors, routers)

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)


def _w(name: str, *ne: int) -> TensorSpec:
    return TensorSpec(name, tuple(ne), "normal")


def _norm(name: str, n: int) -> TensorSpec:
    return TensorSpec(name, (n,), "norm", f32=True)


def _bias(name: str, n: int) -> TensorSpec:
    return TensorSpec(name, (n,), "bias", f32=True)


def _attention(s: ModelShape, p: str, *, bias: bool = False) -> list[TensorSpec]:
    t = [
        _w(f"{p}.attn_q.weight", s.n_embd, s.n_embd_q),
        _w(f"{p}.attn_k.weight", s.n_embd, s.n_embd_kv),
        _w(f"{p}.attn_v.weight", s.n_embd, s.n_embd_kv),
    ]
    if bias:
        t += [_bias(f"{p}.attn_q.bias", s.n_embd_q), _bias(f"{p}.attn_k.bias", s.n_embd_kv),
              _bias(f"{p}.attn_v.bias", s.n_embd_kv)]
    t.append(_w(f"{p}.attn_output.weight", s.n_embd_q, s.n_embd))
    return t


def _routed_experts(s: ModelShape, p: str) -> list[TensorSpec]:
    from .gguf_file import block_expert_tensor_name  # gguf_file imports gguf, which this module defers

    return [
        TensorSpec(f"{p}.ffn_gate_inp.weight", (s.n_embd, s.n_expert), "router", f32=True),
        _w(f"{p}.{block_expert_tensor_name('gate')}", s.n_embd, s.n_ff_exp, s.n_expert),
        _w(f"{p}.{block_expert_tensor_name('down')}", s.n_ff_exp, s.n_embd, s.n_expert),
        _w(f"{p}.{block_expert_tensor_name('up')}", s.n_embd, s.n_ff_exp, s.n_expert),
    ]


def _block_qwen2moe(s: ModelShape, i: int) -> list[TensorSpec]:
    p = f"blk.{i}"
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd),
        *_attention(s, p, bias=True),
        _norm(f"{p}.ffn_norm.weight", s.n_embd),
        *_routed_experts(s, p),
        TensorSpec(f"{p}.ffn_gate_inp_shexp.weight", (s.n_embd,), "normal", f32=True),
        _w(f"{p}.ffn_gate_shexp.weight", s.n_embd, s.n_ff_shexp),
        _w(f"{p}.ffn_down_shexp.weight", s.n_ff_shexp, s.n_embd),
        _w(f"{p}.ffn_up_shexp.weight", s.n_embd, s.n_ff_shexp),
    ]


def _block_qwen3moe(s: ModelShape, i: int) -> list[TensorSpec]:
    p = f"blk.{i}"
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd),
        *_attention(s, p),
        _norm(f"{p}.attn_k_norm.weight", s.head_dim),
        _norm(f"{p}.attn_q_norm.weight", s.head_dim),
        _norm(f"{p}.ffn_norm.weight", s.n_embd),
        *_routed_experts(s, p),
    ]


def _block_llama(s: ModelShape, i: int) -> list[TensorSpec]:
    p = f"blk.{i}"
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd),
        *_attention(s, p),
        _norm(f"{p}.ffn_norm.weight", s.n_embd),
        *_routed_experts(s, p),
    ]


def _block_olmoe(s: ModelShape, i: int) -> list[TensorSpec]:
    p = f"blk.{i}"
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd),
        *_attention(s, p),
        # whole-vector norms over all heads: q over n_embd_q, k over n_embd_kv (llama.cpp: both n_embd)
        _norm(f"{p}.attn_q_norm.weight", s.n_embd_q),
        _norm(f"{p}.attn_k_norm.weight", s.n_embd_kv),
        _norm(f"{p}.ffn_norm.weight", s.n_embd),
        *_routed_experts(s, p),
    ]


def _meta_common(s: ModelShape, kv: dict[str, Any]) -> None:
    a = s.arch
    kv[f"{a}.vocab_size"] = None  # filled in with the tokenizer's size
    kv[f"{a}.context_length"] = s.n_ctx
    kv[f"{a}.embedding_length"] = s.n_embd
    kv[f"{a}.block_count"] = s.n_layer
    kv[f"{a}.feed_forward_length"] = s.n_ff or s.n_ff_exp
    kv[f"{a}.attention.head_count"] = s.n_head
    kv[f"{a}.attention.head_count_kv"] = s.n_head_kv
    kv[f"{a}.rope.freq_base"] = float(s.rope_theta)
    kv[f"{a}.attention.layer_norm_rms_epsilon"] = float(s.rms_eps)
    kv[f"{a}.expert_count"] = s.n_expert
    kv[f"{a}.expert_used_count"] = s.n_expert_used
    if s.head_dim * s.n_head != s.n_embd:
        kv[f"{a}.attention.key_length"] = s.head_dim
        kv[f"{a}.attention.value_length"] = s.head_dim


def _meta_qwen2moe(s: ModelShape, kv: dict[str, Any]) -> None:
    _meta_common(s, kv)
    kv["qwen2moe.expert_feed_forward_length"] = s.n_ff_exp
    kv["qwen2moe.expert_shared_feed_forward_length"] = s.n_ff_shexp


def _meta_qwen3moe(s: ModelShape, kv: dict[str, Any]) -> None:
    _meta_common(s, kv)
    kv["qwen3moe.expert_feed_forward_length"] = s.n_ff_exp
    kv["qwen3moe.attention.key_length"] = s.head_dim
    kv["qwen3moe.attention.value_length"] = s.head_dim


def _meta_llama(s: ModelShape, kv: dict[str, Any]) -> None:
    # llama (Mixtral): experts are n_ff wide; LLAMA_ROPE_TYPE_NORM (adjacent pairs) on un-permuted q/k.
    if s.n_ff and s.n_ff != s.n_ff_exp:
        raise SpecterError("llama MoE: experts are feed_forward_length wide; set n_ff = n_ff_exp")
    _meta_common(s, kv)
    kv["llama.rope.dimension_count"] = s.head_dim


def _meta_olmoe(s: ModelShape, kv: dict[str, Any]) -> None:
    if s.n_ff and s.n_ff != s.n_ff_exp:
        raise SpecterError("olmoe: experts are feed_forward_length wide; set n_ff = n_ff_exp")
    if s.n_head_kv != s.n_head or s.n_embd_q != s.n_embd:
        raise SpecterError("olmoe: llama.cpp sizes attn_q_norm/attn_k_norm as n_embd; "
                           "needs n_head_kv == n_head and n_head * head_dim == n_embd")
    _meta_common(s, kv)


# ---- deepseek2 (MLA) and phimoe: layouts as llama.cpp 0.3.36 loads them (src/models/{deepseek2,phimoe}.cpp)


def _block_deepseek2(s: ModelShape, i: int) -> list[TensorSpec]:
    p, d, H = f"blk.{i}", s.n_embd, s.n_head
    r, rot, dk, dv = s.kv_lora_rank, s.qk_rope_dim, s.head_dim, s.v_head_dim
    nope = dk - rot
    t = [_norm(f"{p}.attn_norm.weight", d)]
    if s.q_lora_rank:
        t += [_w(f"{p}.attn_q_a.weight", d, s.q_lora_rank), _norm(f"{p}.attn_q_a_norm.weight", s.q_lora_rank),
              _w(f"{p}.attn_q_b.weight", s.q_lora_rank, H * dk)]
    else:
        t.append(_w(f"{p}.attn_q.weight", d, H * dk))
    t += [_w(f"{p}.attn_kv_a_mqa.weight", d, r + rot), _norm(f"{p}.attn_kv_a_norm.weight", r)]
    if s.mla_legacy:
        t.append(_w(f"{p}.attn_kv_b.weight", r, H * (nope + dv)))
    else:
        t += [_w(f"{p}.attn_k_b.weight", nope, r, H), _w(f"{p}.attn_v_b.weight", r, dv, H)]
    t += [_w(f"{p}.attn_output.weight", H * dv, d), _norm(f"{p}.ffn_norm.weight", d)]
    if i < s.n_leading_dense:
        return t + [_w(f"{p}.ffn_gate.weight", d, s.n_ff), _w(f"{p}.ffn_down.weight", s.n_ff, d),
                    _w(f"{p}.ffn_up.weight", d, s.n_ff)]
    t += _routed_experts(s, p)
    if s.exp_probs_b:
        t.append(_bias(f"{p}.exp_probs_b.bias", s.n_expert))
    f = s.n_ff_exp * s.n_expert_shared
    if f:
        t += [_w(f"{p}.ffn_gate_shexp.weight", d, f), _w(f"{p}.ffn_down_shexp.weight", f, d),
              _w(f"{p}.ffn_up_shexp.weight", d, f)]
    return t


def _meta_deepseek2(s: ModelShape, kv: dict[str, Any]) -> None:
    # what convert_hf_to_gguf.py (conversion/deepseek.py) writes: MLA as MQA over [latent | rope key]
    a, r, rot = "deepseek2", s.kv_lora_rank, s.qk_rope_dim
    if not (r and rot and s.v_head_dim and s.head_dim > rot):
        raise SpecterError("deepseek2 needs kv_lora_rank, qk_rope_dim, v_head_dim and head_dim > qk_rope_dim")
    _meta_common(s, kv)
    kv.pop(f"{a}.attention.key_length", None)
    kv.pop(f"{a}.attention.value_length", None)
    kv[f"{a}.feed_forward_length"] = s.n_ff or s.n_ff_exp
    if s.mla_legacy:  # older files: decompressed MHA head sizes, no *_mla keys
        kv[f"{a}.attention.head_count_kv"] = s.n_head
        kv[f"{a}.attention.key_length"] = s.head_dim
        kv[f"{a}.attention.value_length"] = s.v_head_dim
    else:
        kv[f"{a}.attention.head_count_kv"] = 1
        kv[f"{a}.attention.key_length"] = r + rot
        kv[f"{a}.attention.value_length"] = r
        kv[f"{a}.attention.key_length_mla"] = s.head_dim
        kv[f"{a}.attention.value_length_mla"] = s.v_head_dim
    kv[f"{a}.leading_dense_block_count"] = s.n_leading_dense
    # llama.cpp requires q_lora_rank unless the file has 26/27 layers (V2-Lite); 0 = attn_q directly
    kv[f"{a}.attention.q_lora_rank"] = s.q_lora_rank
    kv[f"{a}.attention.kv_lora_rank"] = r
    kv[f"{a}.expert_feed_forward_length"] = s.n_ff_exp
    kv[f"{a}.expert_shared_count"] = s.n_expert_shared
    if s.expert_weights_scale:
        kv[f"{a}.expert_weights_scale"] = float(s.expert_weights_scale)
    if s.expert_weights_norm:
        kv[f"{a}.expert_weights_norm"] = True
    if s.expert_gating_func:
        kv[f"{a}.expert_gating_func"] = s.expert_gating_func
    if s.n_expert_groups > 1:
        kv[f"{a}.expert_group_count"] = s.n_expert_groups
        kv[f"{a}.expert_group_used_count"] = s.n_group_used
    kv[f"{a}.rope.dimension_count"] = rot
    if s.rope_scaling == "yarn":
        kv[f"{a}.rope.scaling.type"] = "yarn"
        kv[f"{a}.rope.scaling.factor"] = float(s.rope_scaling_factor)
        kv[f"{a}.rope.scaling.original_context_length"] = s.rope_orig_ctx
        kv[f"{a}.rope.scaling.yarn_beta_fast"] = 32.0
        kv[f"{a}.rope.scaling.yarn_beta_slow"] = 1.0
        if s.yarn_mscale_all_dim:
            kv[f"{a}.rope.scaling.yarn_log_multiplier"] = 0.1 * s.yarn_mscale_all_dim


def _block_phimoe(s: ModelShape, i: int) -> list[TensorSpec]:
    p = f"blk.{i}"
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd), _bias(f"{p}.attn_norm.bias", s.n_embd),
        *_attention(s, p, bias=True), _bias(f"{p}.attn_output.bias", s.n_embd),
        _norm(f"{p}.ffn_norm.weight", s.n_embd), _bias(f"{p}.ffn_norm.bias", s.n_embd),
        *_routed_experts(s, p),
    ]


def _meta_phimoe(s: ModelShape, kv: dict[str, Any]) -> None:
    # conversion/phi.py (Phi3MiniModel + PhiMoeModel): experts are feed_forward_length wide; longrope
    if s.n_ff and s.n_ff != s.n_ff_exp:
        raise SpecterError("phimoe: experts are feed_forward_length wide; set n_ff = n_ff_exp")
    if s.n_embd_q != s.n_embd:
        raise SpecterError("phimoe: llama.cpp needs n_head * head_dim == n_embd")
    _meta_common(s, kv)
    kv["phimoe.rope.dimension_count"] = s.head_dim
    if s.rope_scaling == "longrope":
        kv["phimoe.rope.scaling.type"] = "longrope"
        kv["phimoe.rope.scaling.original_context_length"] = s.rope_orig_ctx
        scale = s.n_ctx / s.rope_orig_ctx
        kv["phimoe.rope.scaling.attn_factor"] = (
            math.sqrt(1 + math.log(scale) / math.log(s.rope_orig_ctx)) if scale > 1.0 else 1.0)


def _extra_phimoe(s: ModelShape, n_vocab: int) -> list[TensorSpec]:
    t = [_bias("output_norm.bias", s.n_embd), _bias("output.bias", n_vocab)]
    if s.rope_scaling == "longrope":
        half = s.head_dim // 2
        t += [TensorSpec("rope_factors_long.weight", (half,), "rope_long", f32=True),
              TensorSpec("rope_factors_short.weight", (half,), "norm", f32=True)]
    return t


@dataclass(frozen=True)
class ArchSpec:
    block: Callable[[ModelShape, int], list[TensorSpec]]
    metadata: Callable[[ModelShape, dict[str, Any]], None]
    extra: Callable[[ModelShape, int], list[TensorSpec]] | None = None  # file-level tensors (shape, n_vocab)


ARCHS: dict[str, ArchSpec] = {
    "qwen2moe": ArchSpec(_block_qwen2moe, _meta_qwen2moe),
    "qwen3moe": ArchSpec(_block_qwen3moe, _meta_qwen3moe),
    "llama": ArchSpec(_block_llama, _meta_llama),
    "olmoe": ArchSpec(_block_olmoe, _meta_olmoe),
    "deepseek2": ArchSpec(_block_deepseek2, _meta_deepseek2),
    "phimoe": ArchSpec(_block_phimoe, _meta_phimoe, _extra_phimoe),
}


def tensor_specs(shape: ModelShape, n_vocab: int) -> list[TensorSpec]:
    """All tensors of the model, in file order (as llama.cpp's converter orders them)."""
    arch = _arch(shape)
    specs = [_w("token_embd.weight", shape.n_embd, n_vocab)]
    for i in range(shape.n_layer):
        specs += arch.block(shape, i)
    specs += [_norm("output_norm.weight", shape.n_embd),
              TensorSpec("output.weight", (shape.n_embd, n_vocab), "output")]
    if arch.extra is not None:
        specs += arch.extra(shape, n_vocab)
    return specs


def architecture_metadata(shape: ModelShape, n_vocab: int) -> dict[str, Any]:
    """The `{arch}.*` keys (python values; ints are written as UINT32, floats as FLOAT32)."""
    kv: dict[str, Any] = {}
    _arch(shape).metadata(shape, kv)
    kv[f"{shape.arch}.vocab_size"] = n_vocab
    return kv


def _arch(shape: ModelShape) -> ArchSpec:
    try:
        return ARCHS[shape.arch]
    except KeyError:
        raise SpecterError(f"architecture {shape.arch!r} not supported by the synthetic writer; "
                           f"choose one of: {', '.join(ARCHS)}") from None


# --------------------------------------------------------------------------------------------------
# Tokenizer: a small byte-level BPE of our own
# --------------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Approximation of Qwen2's pre-tokenizer regex with the `re` module (\p{L} -> [^\W\d_], \p{N} -> \d).
# Merges are learned inside these pieces; llama.cpp applies its own (exact) qwen2 split at run time.
_PRETOKENIZE = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+"
    r"|\d"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class BPETokenizer:
    """A byte-level BPE vocabulary: tokens (id order), merges (rank order) and special tokens."""

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    specials: tuple[str, ...] = SPECIAL_TOKENS

    def gguf_metadata(self) -> dict[str, tuple[Any, Any, Any]]:
        """tokenizer.* keys as {key: (value, GGUFValueType, array sub-type)}."""
        import gguf

        T = gguf.GGUFValueType
        ttype = [int(gguf.TokenType.CONTROL) if t in self.specials else int(gguf.TokenType.NORMAL)
                 for t in self.tokens]
        eos = self.tokens.index("<|endoftext|>")
        return {
            "tokenizer.ggml.model": ("gpt2", T.STRING, None),
            "tokenizer.ggml.pre": ("qwen2", T.STRING, None),
            "tokenizer.ggml.tokens": (list(self.tokens), T.ARRAY, T.STRING),
            "tokenizer.ggml.token_type": (ttype, T.ARRAY, T.INT32),
            "tokenizer.ggml.merges": (list(self.merges), T.ARRAY, T.STRING),
            "tokenizer.ggml.eos_token_id": (eos, T.UINT32, None),
            "tokenizer.ggml.bos_token_id": (eos, T.UINT32, None),
            "tokenizer.ggml.padding_token_id": (eos, T.UINT32, None),
            "tokenizer.ggml.add_bos_token": (False, T.BOOL, None),
            "tokenizer.chat_template": (CHATML_TEMPLATE, T.STRING, None),
        }

    def to_json(self) -> str:
        return json.dumps({"tokens": list(self.tokens), "merges": list(self.merges),
                           "specials": list(self.specials)}, ensure_ascii=False, indent=0)


def train_bpe(text: str, vocab_size: int = 1024, min_count: int = 2,
              specials: Sequence[str] = SPECIAL_TOKENS) -> BPETokenizer:
    """Train byte-level BPE merges on `text` until `vocab_size` tokens (256 bytes + merges + specials)
    or no pair occurs `min_count` times. Deterministic (ties broken by the pair's text)."""
    for sp in specials:  # special tokens are not learned from
        text = text.replace(sp, "\n")
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in piece.encode("utf-8"))
                    for piece in _PRETOKENIZE.findall(text))
    syms: list[list[str]] = [list(w) for w in words]
    freq: list[int] = list(words.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, s in enumerate(syms):
        for a, b in zip(s, s[1:]):
            pairs[(a, b)] += freq[wi]
            where[(a, b)].add(wi)

    base = [b2u[b] for b in sorted(b2u, key=lambda b: ord(b2u[b]))]
    n_merges = vocab_size - len(base) - len(specials)
    merges: list[tuple[str, str]] = []
    vocab = set(base)
    new_tokens: list[str] = []
    while len(merges) < n_merges and pairs:
        best, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < min_count:
            break
        merged = best[0] + best[1]
        merges.append(best)
        if merged not in vocab:
            vocab.add(merged)
            new_tokens.append(merged)
        for wi in list(where.pop(best, ())):
            s, f = syms[wi], freq[wi]
            for a, b in zip(s, s[1:]):  # remove this word's old pairs
                pairs[(a, b)] -= f
                if pairs[(a, b)] <= 0:
                    del pairs[(a, b)]
                where.get((a, b), set()).discard(wi)
            out, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == best[0] and s[j + 1] == best[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            syms[wi] = out
            for a, b in zip(out, out[1:]):
                pairs[(a, b)] += f
                where[(a, b)].add(wi)
        pairs.pop(best, None)
    tokens = tuple(base + new_tokens + list(specials))
    return BPETokenizer(tokens, tuple(f"{a} {b}" for a, b in merges), tuple(specials))


@functools.lru_cache(maxsize=4)
def tiny_tokenizer(corpus: str | Path | None = None, vocab_size: int = 1024) -> BPETokenizer:
    """The tiny models' tokenizer, trained on the corpus shipped in models/ (cached per process)."""
    path = Path(corpus) if corpus is not None else CORPUS_PATH
    if not path.is_file():
        raise SpecterError(f"tokenizer corpus {path} not found; it ships in the repository's models/")
    return train_bpe(path.read_text(encoding="utf-8"), vocab_size=vocab_size)


def vocab_metadata_from_gguf(path: str | Path) -> tuple[dict[str, tuple[Any, Any, Any]], int]:
    """Every tokenizer.* key of a GGUF (e.g. llama.cpp's models/ggml-vocab-qwen2.gguf), and n_vocab."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise SpecterError(f"vocab GGUF {path} not found")
    reader = gguf.GGUFReader(path)
    T = gguf.GGUFValueType
    out: dict[str, tuple[Any, Any, Any]] = {}
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == T.ARRAY else None
        if vtype == T.ARRAY and len(f.types) > 2:
            raise SpecterError(f"{path}: nested array key {key} is not supported")
        out[key] = (f.contents(), vtype, sub)
    if "tokenizer.ggml.tokens" not in out:
        raise SpecterError(f"{path} has no tokenizer.ggml.tokens; is it a vocab GGUF?")
    return out, len(out["tokenizer.ggml.tokens"][0])


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


@dataclass
class WriteResult:
    path: Path
    shape: ModelShape
    dtype: str
    n_vocab: int
    n_params: int
    n_bytes: int  # file size
    seconds: float
    tensors: list[str] = field(default_factory=list)


def _tensor_seed(seed: int, arch: str, name: str, slab: int) -> int:
    h = hashlib.sha256(f"{seed}/{arch}/{name}/{slab}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _std(spec: TensorSpec, shape: ModelShape) -> float:
    if spec.init == "router":
        return shape.router_logit_std / math.sqrt(shape.n_embd)
    if spec.init == "output":
        return shape.logit_std / math.sqrt(shape.n_embd)
    if spec.init == "norm":
        return shape.norm_noise
    return shape.init_std


def _storage(spec: TensorSpec, dtype: str) -> Any:
    """The GGMLQuantizationType a tensor is stored as (see the module docstring)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if spec.f32 or dtype == "f32" or (dtype == "q8_0" and len(spec.ne) < 2):
        return Q.F32
    if dtype == "q8_0":
        return Q.Q8_0 if spec.ne[0] % Q8_0_BLOCK == 0 else Q.F16
    return Q.F16 if dtype == "f16" else Q.BF16


def tensor_type(spec: TensorSpec, dtype: str) -> str:
    """The GGML type name ("F32", "F16", "BF16", "Q8_0") `spec` is written as in a `dtype` file."""
    return _storage(spec, dtype).name


def _nbytes(spec: TensorSpec, qtype: Any) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return spec.n_elements // block * size


def data_bytes(shape: ModelShape, n_vocab: int, dtype: str) -> int:
    """Bytes of tensor data in a `dtype` file of `shape` (the file is this plus header and alignment)."""
    return sum(_nbytes(s, _storage(s, dtype)) for s in tensor_specs(shape, n_vocab))


def q8_0_blocks(x: Any) -> Any:
    """Q8_0 blocks of a float32 torch tensor, on its device: uint8 of shape (*x.shape[:-1], x.shape[-1] // 32 *
    34), the bytes llama.cpp stores (per block of 32 values along the last dimension: f16 d = amax / 127, then
    int8 q = roundf(x / d), computed as x * (1 / d) with d in float32, as ggml's quantize_row_q8_0_ref and
    gguf.quants do). Bit-identical to ``gguf.quants.quantize(x, Q8_0)``; the last dimension must be a
    multiple of 32. On the CPU it works through cache-sized chunks (faster than whole-slab passes)."""
    import torch

    if x.ndim == 0 or x.shape[-1] % Q8_0_BLOCK:
        raise SpecterError(f"Q8_0 needs rows that are a multiple of {Q8_0_BLOCK} values, got {tuple(x.shape)}")
    blocks = x.to(torch.float32).reshape(-1, Q8_0_BLOCK)
    out = torch.empty((blocks.shape[0], 2 + Q8_0_BLOCK), dtype=torch.uint8, device=x.device)
    step = _Q8_0_CHUNK_BLOCKS if x.device.type == "cpu" else max(1, blocks.shape[0])
    for i in range(0, blocks.shape[0], step):
        b = blocks[i:i + step]
        d = b.abs().amax(dim=1, keepdim=True)
        # true divisions: CUDA turns a division by a scalar into a multiplication by its reciprocal
        d = d.div_(torch.full_like(d, 127.0))
        inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d).div_(d))
        v = b * inv
        s = v.sign()
        a = v.abs_()
        f = a.floor()
        q = a.sub_(f).mul_(2).floor_().add_(f).mul_(s)  # roundf (half away from zero), as gguf's np_roundf
        out[i:i + step, :2] = d.to(torch.float16).view(torch.uint8)
        out[i:i + step, 2:] = q.to(torch.int8).view(torch.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // Q8_0_BLOCK * (2 + Q8_0_BLOCK))


def quantize_q8_0(a: np.ndarray) -> np.ndarray:
    """Numpy in, numpy out: :func:`q8_0_blocks` of `a` (as float32), equal to gguf.quants.quantize(a, Q8_0)."""
    import torch

    return q8_0_blocks(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))).numpy()


def _slabs(spec: TensorSpec, shape: ModelShape, dtype: str, seed: int, device: str) -> Iterator[np.ndarray]:
    """The tensor's data as consecutive numpy slabs (row-major, outermost numpy dim split)."""
    import torch

    np_shape = spec.numpy_shape
    inner = math.prod(np_shape[1:])
    rows_per = max(1, _SLAB_ELEMS // max(1, inner))
    std = _std(spec, shape)
    qtype = _storage(spec, dtype)
    for slab, r0 in enumerate(range(0, np_shape[0], rows_per)):
        rows = min(rows_per, np_shape[0] - r0)
        g = torch.Generator(device=device)
        g.manual_seed(_tensor_seed(seed, shape.arch, spec.name, slab))
        t = torch.randn((rows, *np_shape[1:]), generator=g, device=device, dtype=torch.float32)
        t.mul_(std)
        if spec.init == "norm":
            t.add_(1.0)
        elif spec.init == "rope_long":  # Phi-3 style long factors: smooth, 1 .. 32 over the dimensions
            n = t.numel()
            t = (1.0 + 31.0 * (torch.arange(n, device=device, dtype=torch.float32) / max(n - 1, 1)) ** 3
                 ).reshape(t.shape)
        name = qtype.name
        if name == "F32":
            a = t.cpu().numpy()
        elif name == "F16":
            a = t.to(torch.float16).cpu().numpy()
        elif name == "Q8_0":  # quantized where generated: only 34 bytes per 32 values leave the device
            a = q8_0_blocks(t).cpu().numpy()
        else:  # BF16: raw 16-bit patterns
            a = t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        yield a


def write_synthetic(
    path: str | Path,
    shape: ModelShape | str,
    dtype: str = "f16",
    *,
    seed: int = 0,
    device: str = "cpu",
    vocab_from: str | Path | None = None,
    tokenizer: BPETokenizer | None = None,
    progress: bool = False,
) -> WriteResult:
    """Write a random-weight GGUF of `shape` (a ModelShape or preset name) to `path`.

    Tensor data is generated and written one tensor (slab) at a time, so memory stays bounded by the
    largest slab (~256 MB of float32, a few times that while quantizing), whatever the model's size.
    `dtype` is the matrices' type: f32, f16, bf16, or q8_0 (quantized slab by slab as generated; routers and
    1-D tensors F32, matrices whose rows are not a multiple of 32 F16 — see the module docstring).
    `vocab_from` copies all tokenizer.* keys of that GGUF; otherwise the tiny BPE tokenizer (or `tokenizer`)
    is used.
    """
    t0 = time.perf_counter()
    if isinstance(shape, str):
        shape = get_preset(shape)
    if dtype not in DTYPES:
        raise SpecterError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    import gguf
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecterError("device 'cuda' requested but torch sees no CUDA GPU; use --device cpu")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    if vocab_from is not None:
        tok_kv, n_vocab = vocab_metadata_from_gguf(vocab_from)
    else:
        tok = tokenizer or tiny_tokenizer()
        tok_kv, n_vocab = tok.gguf_metadata(), len(tok.tokens)

    specs = tensor_specs(shape, n_vocab)
    arch_kv = architecture_metadata(shape, n_vocab)

    w = gguf.GGUFWriter(path, shape.arch)
    w.add_name(shape.name or shape.arch)
    w.add_description("specter-gguf synthetic model: random weights (produces gibberish)")
    w.add_file_type(_FILE_TYPE[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    T = gguf.GGUFValueType
    for k, v in arch_kv.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_key_value(k, v, T.STRING)
    for k, (v, vtype, sub) in tok_kv.items():
        w.add_key_value(k, v, vtype, sub)

    total = 0
    for spec in specs:
        qtype = _storage(spec, dtype)
        nbytes = _nbytes(spec, qtype)
        total += nbytes
        # for BF16/Q8_0 the numpy dtype only says "not uint8": the shape is given in elements
        np_dtype = {"F32": np.float32, "F16": np.float16}.get(qtype.name, np.uint16)
        w.add_tensor_info(spec.name, spec.numpy_shape, np.dtype(np_dtype), nbytes,
                          raw_dtype=None if qtype.name in ("F32", "F16") else qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name)
    try:
        for spec in specs:
            fout.write(b"\0" * ((-fout.tell()) % align))
            for a in _slabs(spec, shape, dtype, seed, device):
                a.tofile(fout)
                if bar is not None:
                    bar.update(a.nbytes)
        fout.write(b"\0" * ((-fout.tell()) % align))
    finally:
        if bar is not None:
            bar.close()
        w.close()
    return WriteResult(path=path, shape=shape, dtype=dtype, n_vocab=n_vocab,
                       n_params=sum(s.n_elements for s in specs), n_bytes=path.stat().st_size,
                       seconds=time.perf_counter() - t0, tensors=[s.name for s in specs])
