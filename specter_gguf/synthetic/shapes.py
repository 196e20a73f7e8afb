"""Model shapes: a :class:`ModelShape` holds a MoE model's hyper-parameters in llama.cpp's terms (the writer's input,
see `writer`); :data:`PRESETS` names the tiny ones the tests use and real ones (HF configs) the benchmark uses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specter_gguf.errors import SpecterError


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
    # initialisation (see `writer`)
    init_std: float = 0.02
    norm_noise: float = 0.1
    router_logit_std: float = 1.5
    logit_std: float = 2.0
    # attention's output product at this multiple of init_std: how much of the router's input is attention's
    # near-uniform average over the context, which consecutive tokens share (`writer`: routing locality)
    attn_output_scale: float = 1.0
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
