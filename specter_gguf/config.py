"""Model hyperparameters read from GGUF metadata, as llama.cpp reads them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile

DEFAULT_CTX_SIZE = 4096  # llama.cpp's default context; a model's own is often 32768 or more


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_dim: int           # leading dims of each head that are rotated
    rope_base: float
    rope_freq_scale: float  # 1 / linear scaling factor
    n_ff: int               # dense FFN width (leading dense layers), 0 when none
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int           # width of one routed expert
    n_ff_shexp: int         # width of the shared expert(s), 0 when none
    expert_weights_scale: float
    n_leading_dense: int    # first layers with a dense FFN instead of experts
    # --- later additions, all with defaults (issue 6: deepseek2, phimoe) ---
    # routing variants (llama.cpp build_moe_ffn)
    expert_weights_norm: bool = False  # renormalize the top-k weights (arch modules may force it)
    expert_gating_func: str = "softmax"  # "softmax" | "sigmoid"
    n_expert_groups: int = 0           # group-limited routing when > 1 (DeepSeek-V2/V3)
    n_group_used: int = 0
    # RoPE scaling as llama.cpp's context computes it (llama-context.cpp): YaRN ramp and magnitude
    rope_scaling: str = "none"         # "none" | "linear" | "yarn" | "longrope"
    rope_ext_factor: float = 0.0       # YaRN extrapolation mix (1 for yarn)
    rope_attn_factor: float = 1.0      # cparams.yarn_attn_factor (passed to ggml_rope_ext)
    n_ctx_orig_yarn: int = 0           # rope.scaling.original_context_length
    yarn_beta_fast: float = 32.0       # llama.cpp's defaults; the file's yarn_beta_* keys are not read by it
    yarn_beta_slow: float = 1.0
    rope_yarn_log_mul: float = 0.0     # deepseek2: mscale_all_dim (the file stores 0.1x)
    # multi-head latent attention (deepseek2)
    n_lora_q: int = 0                  # 0: q from attn_q directly (DeepSeek-V2-Lite)
    n_lora_kv: int = 0                 # width of the cached latent (kv_lora_rank); > 0 means MLA
    head_dim_k_mla: int = 0            # qk_nope + qk_rope
    head_dim_v_mla: int = 0
    mla_split_kv_b: bool = False       # attn_k_b + attn_v_b (current converter) instead of legacy attn_kv_b

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelConfig:
        a = f.architecture

        def key(name: str, default: Any = None) -> Any:
            value = f.get(f"{a}.{name}", default) if default is not None else f.require(f"{a}.{name}")
            return value[0] if isinstance(value, list) else value  # per-layer arrays: uniform models only

        n_expert = int(key("expert_count", 0))
        if n_expert == 0:
            raise SpecterError(f"{f.path}: '{a}' model has no experts ({a}.expert_count is 0 or missing); "
                               f"specter-gguf runs Mixture-of-Experts models only — use llama.cpp for dense models")
        if int(key("block_count")) < 1:
            raise SpecterError(f"{f.path}: {a}.block_count is {key('block_count')}: the model has no layers")
        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        n_expert_used = int(key("expert_used_count"))
        n_ff = int(key("feed_forward_length", 0))
        n_vocab = len(f.get("tokenizer.ggml.tokens", [])) or f.tensor("token_embd.weight").shape[0]
        scaling = str(f.get(f"{a}.rope.scaling.type", "linear"))  # llama.cpp's default when absent
        factor = float(f.get(f"{a}.rope.scaling.factor", 0.0) or 0.0)
        if scaling not in ("none", "linear", "yarn", "longrope") and factor not in (0.0, 1.0):
            raise SpecterError(f"{f.path}: RoPE scaling '{scaling}' is not supported for '{a}' yet; "
                               f"remove {a}.rope.scaling.* from the file to run it at its original context")
        cfg = cls(
            arch=a,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length", 4096)),
            n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_dim=int(key("rope.dimension_count", head_dim)),
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / factor if scaling != "none" and factor > 0 else 1.0,
            n_ff=n_ff,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            # qwen2moe files carry a shared expert without saying so in metadata
            n_expert_shared=int(key("expert_shared_count", 0)) or int(any("_shexp." in n for n in f.tensors)),
            n_ff_exp=int(key("expert_feed_forward_length", 0)) or _default_expert_width(a, n_ff, n_expert_used),
            n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)) or n_ff,
            expert_weights_scale=float(key("expert_weights_scale", 0.0)),
            n_leading_dense=int(key("leading_dense_block_count", 0)),
        )
        return _extended(cfg, f, key, scaling)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def context_size(self, requested: int | None) -> int:
        """The context a run uses for `requested` tokens, as llama.cpp's -c reads it: None gives
        min(training context, DEFAULT_CTX_SIZE), 0 the training context."""
        if requested is None:
            return min(self.n_ctx_train, DEFAULT_CTX_SIZE)
        if requested < 0:
            raise SpecterError(f"context size must be 0 (the model's own, {self.n_ctx_train}) or positive, "
                               f"got {requested}")
        return requested or self.n_ctx_train



def _default_expert_width(arch: str, n_ff: int, n_expert_used: int) -> int:
    """llama.cpp's fallback when `expert_feed_forward_length` is absent: Qwen files split the FFN width over
    the used experts; Mixtral and OLMoE store the expert width as `feed_forward_length`."""
    return n_ff // max(n_expert_used, 1) if arch in ("qwen2moe", "qwen3moe") else n_ff


def _extended(cfg: ModelConfig, f: GGUFFile, key: Any, scaling: str) -> ModelConfig:
    """Routing variants, RoPE scaling and MLA fields, read as llama.cpp reads them (llama-model.cpp,
    llama-context.cpp, src/models/deepseek2.cpp)."""
    import dataclasses
    import math

    a = cfg.arch
    gating = {0: "softmax", 1: "softmax", 2: "sigmoid"}.get(int(key("expert_gating_func", 0)))
    if gating is None:
        raise SpecterError(f"{f.path}: {a}.expert_gating_func {key('expert_gating_func')} is not supported "
                           f"(softmax = 1, sigmoid = 2)")
    kw: dict[str, Any] = dict(
        expert_weights_norm=bool(key("expert_weights_norm", False)),
        expert_gating_func=gating,
        n_expert_groups=int(key("expert_group_count", 0)),
        n_group_used=int(key("expert_group_used_count", 0)),
        rope_scaling=scaling,
        n_ctx_orig_yarn=int(key("rope.scaling.original_context_length", 0)) or cfg.n_ctx_train,
    )
    # the attention factor llama.cpp's context passes to every ggml_rope_ext (llama-context.cpp)
    log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0))
    if a == "deepseek2" and log_mul != 0.0:
        log_mul /= 0.1  # the converter stores 0.1 * mscale_all_dim
    attn_factor, ext_factor = 1.0, 1.0 if scaling == "yarn" else 0.0
    if ext_factor != 0.0:
        factor = 1.0 / cfg.rope_freq_scale

        def mscale(s: float, m: float) -> float:
            return 1.0 if s <= 1.0 else 0.1 * m * math.log(s) + 1.0

        if log_mul != 0.0:
            m = log_mul if a == "deepseek2" and log_mul != 1.0 else 1.0
            attn_factor = mscale(factor, m) / mscale(factor, log_mul)
        else:
            attn_factor = mscale(factor, 1.0)
        attn_factor *= 1.0 / (1.0 + 0.1 * math.log(factor))
    attn_factor *= float(key("rope.scaling.attn_factor", 1.0))
    kw.update(rope_ext_factor=ext_factor, rope_attn_factor=attn_factor, rope_yarn_log_mul=log_mul)

    if a == "deepseek2":
        n_vocab = cfg.n_vocab
        lite = cfg.n_layer in (26, 27) or (cfg.n_layer == 48 and n_vocab == 128256)  # llama.cpp's is_lite
        k_mla, v_mla = int(key("attention.key_length_mla", 0)), int(key("attention.value_length_mla", 0))
        split = k_mla != 0 and v_mla != 0
        head_k = k_mla if split else cfg.head_dim
        head_v = v_mla if split else int(key("attention.value_length", cfg.head_dim))
        kw.update(
            n_lora_q=0 if lite else int(key("attention.q_lora_rank", 0)),
            n_lora_kv=int(key("attention.kv_lora_rank")),
            head_dim_k_mla=head_k, head_dim_v_mla=head_v, mla_split_kv_b=split,
            n_ff_shexp=cfg.n_ff_exp * cfg.n_expert_shared,
        )
        if head_k - cfg.rope_dim < 1:
            raise SpecterError(f"{f.path}: deepseek2 key length {head_k} leaves no non-rotated dims "
                               f"(rope.dimension_count {cfg.rope_dim})")
    return dataclasses.replace(cfg, **kw)
