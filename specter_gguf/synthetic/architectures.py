"""Each architecture's GGUF layout, as llama.cpp's converter writes it: per architecture (qwen2moe, qwen3moe,
llama/Mixtral, olmoe, deepseek2 with MLA, phimoe), a function that lists a block's tensors (name, ggml shape, how to
initialise it), one that writes the architecture's metadata keys and, where the architecture has them, one that
lists file-level tensors beyond the embedding, final norm and LM head (phimoe's biases and rope factors), gathered
in :data:`ARCHS`. Another architecture is one more :class:`ArchSpec` entry (plus any new ``ModelShape`` fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specter_gguf.errors import SpecterError
from specter_gguf.synthetic.shapes import ModelShape


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
    from specter_gguf.gguf_file import block_expert_tensor_name  # gguf_file imports gguf, which this module defers

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


def _block_plain(s: ModelShape, i: int, qk_norms: Sequence[tuple[str, int]] = ()) -> list[TensorSpec]:
    """A block of attention (with `qk_norms`, (name, width) in file order, after it) and routed experts only."""
    p = f"blk.{i}"
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd),
        *_attention(s, p),
        *(_norm(f"{p}.{name}.weight", n) for name, n in qk_norms),
        _norm(f"{p}.ffn_norm.weight", s.n_embd),
        *_routed_experts(s, p),
    ]


def _block_qwen3moe(s: ModelShape, i: int) -> list[TensorSpec]:
    return _block_plain(s, i, [("attn_k_norm", s.head_dim), ("attn_q_norm", s.head_dim)])


def _block_olmoe(s: ModelShape, i: int) -> list[TensorSpec]:
    # whole-vector norms over all heads: q over n_embd_q, k over n_embd_kv (llama.cpp: both n_embd)
    return _block_plain(s, i, [("attn_q_norm", s.n_embd_q), ("attn_k_norm", s.n_embd_kv)])


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
    "llama": ArchSpec(_block_plain, _meta_llama),
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
