"""Model hyperparameters read from GGUF metadata, as llama.cpp reads them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile

DEFAULT_CTX_SIZE = 4096  # llama.cpp's default context; a model's own is often 32768 or more
MAX_DIM = 1 << 20        # bounds on widths and counts, far above any real model's, to refuse corrupt values early
MAX_EXPERTS = 1 << 12


def meta_value(f: GGUFFile, key: str, default: Any = None, kind: type = int, lo: float | None = None,
               hi: float | None = None) -> Any:
    """Metadata `key` checked for its type (`kind`: int, float, bool or str; a per-layer array gives its first
    item) and its range [lo, hi], or `default` when absent (required when `default` is None): the one place
    the model's hyperparameters are validated, so that a corrupt value is one message, not a traceback later."""
    value = f.get(key) if default is not None else f.require(key)
    if value is None:
        return default
    if isinstance(value, list):  # per-layer arrays: uniform models only
        if not value:
            raise SpecterError(f"{f.path}: {key} is an empty array; the file's metadata is corrupt — convert the "
                               f"model again")
        value = value[0]
    ok = {int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          bool: isinstance(value, (bool, int)) and value in (0, 1),
          str: isinstance(value, str)}[kind]
    if not ok:
        want = {int: "an integer", float: "a finite number", bool: "a boolean", str: "a string"}[kind]
        raise SpecterError(f"{f.path}: {key} is {value!r}, expected {want}; the file's metadata is corrupt — "
                           f"convert the model again")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise SpecterError(f"{f.path}: {key} is {value!r}, expected {bounds}; the file's metadata is corrupt — "
                           f"convert the model again")
    return kind(value)


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
        if not isinstance(f.get("general.architecture"), str):
            raise SpecterError(f"{f.path}: general.architecture is {f.get('general.architecture')!r}, not a "
                               f"string; the file's metadata is corrupt — convert the model again")

        def key(name: str, default: Any = None, kind: type = int, lo: float | None = None,
                hi: float | None = None) -> Any:
            return meta_value(f, f"{a}.{name}", default, kind, lo, hi)

        n_expert = key("expert_count", 0, lo=0, hi=MAX_EXPERTS)
        if n_expert == 0:
            raise SpecterError(f"{f.path}: '{a}' model has no experts ({a}.expert_count is 0 or missing); "
                               f"specter-gguf runs Mixture-of-Experts models only — use llama.cpp for dense models")
        n_layer = key("block_count", lo=0, hi=MAX_DIM)
        if n_layer < 1:
            raise SpecterError(f"{f.path}: {a}.block_count is {n_layer}: the model has no layers")
        n_embd = key("embedding_length", lo=1, hi=MAX_DIM)
        n_head = key("attention.head_count", lo=1, hi=MAX_DIM)
        n_head_kv = key("attention.head_count_kv", n_head, lo=1, hi=n_head)
        if n_head % n_head_kv:
            raise SpecterError(f"{f.path}: {a}.attention.head_count ({n_head}) is not a multiple of "
                               f"{a}.attention.head_count_kv ({n_head_kv}); the file's metadata is corrupt")
        head_dim = key("attention.key_length", max(n_embd // n_head, 1), lo=1, hi=MAX_DIM)
        n_expert_used = key("expert_used_count", lo=1, hi=n_expert)
        n_ff = key("feed_forward_length", 0, lo=0, hi=MAX_DIM)
        tokens = f.get("tokenizer.ggml.tokens", [])
        n_vocab = len(tokens) if isinstance(tokens, list) and tokens else f.tensor("token_embd.weight").shape[0]
        scaling = meta_value(f, f"{a}.rope.scaling.type", "linear", str)  # llama.cpp's default when absent
        factor = meta_value(f, f"{a}.rope.scaling.factor", 0.0, float, 0.0)
        if scaling not in ("none", "linear", "yarn", "longrope") and factor not in (0.0, 1.0):
            raise SpecterError(f"{f.path}: RoPE scaling '{scaling}' is not supported for '{a}' yet; "
                               f"remove {a}.rope.scaling.* from the file to run it at its original context")
        n_expert_shared = key("expert_shared_count", 0, lo=0, hi=MAX_EXPERTS)
        n_ff_exp = key("expert_feed_forward_length", 0, lo=0, hi=MAX_DIM)
        cfg = cls(
            arch=a,
            n_layer=n_layer,
            n_embd=n_embd,
            n_vocab=n_vocab,
            n_ctx_train=key("context_length", 4096, lo=1, hi=2**31 - 1),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            rms_eps=key("attention.layer_norm_rms_epsilon", kind=float, lo=0.0, hi=1.0),
            rope_dim=key("rope.dimension_count", head_dim, lo=0, hi=head_dim),
            rope_base=key("rope.freq_base", 10000.0, float, lo=1e-3),
            rope_freq_scale=1.0 / factor if scaling != "none" and factor > 0 else 1.0,
            n_ff=n_ff,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            # qwen2moe files carry a shared expert without saying so in metadata
            n_expert_shared=n_expert_shared or int(any("_shexp." in n for n in f.tensors)),
            n_ff_exp=n_ff_exp or _default_expert_width(a, n_ff, n_expert_used),
            n_ff_shexp=key("expert_shared_feed_forward_length", 0, lo=0, hi=MAX_DIM) or n_ff,
            expert_weights_scale=key("expert_weights_scale", 0.0, float, lo=0.0),
            n_leading_dense=key("leading_dense_block_count", 0, lo=0, hi=n_layer),
        )
        if cfg.n_ff_exp < 1:
            raise SpecterError(f"{f.path}: the expert width is 0 ({a}.expert_feed_forward_length and "
                               f"{a}.feed_forward_length are 0 or missing); the file's metadata is incomplete")
        if cfg.rope_dim % 2:
            raise SpecterError(f"{f.path}: {a}.rope.dimension_count is {cfg.rope_dim}, not even; the file's "
                               f"metadata is corrupt — convert the model again")
        return _extended(cfg, f, key, scaling)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def context_size(self, requested: int | None) -> int:
        """The context a run uses for `requested` tokens, as llama.cpp's -c reads it: None gives
        min(training context, DEFAULT_CTX_SIZE), 0 the training context."""
        if requested is None:
            return min(self.n_ctx_train, DEFAULT_CTX_SIZE)
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise SpecterError(f"context size must be a whole number of tokens, got {requested!r}")
        if requested < 0:
            raise SpecterError(f"context size must be 0 (the model's own, {self.n_ctx_train}) or positive, "
                               f"got {requested}")
        return requested or self.n_ctx_train


def check_room(n_prompt: int, n_predict: int, ctx_size: int, what: str) -> None:
    """Refuse a measurement whose prompt (`what`, `n_prompt` tokens) and `n_predict` generated tokens do not fit the
    context `ctx_size`: its generations would stop early and average fewer tokens than it says."""
    if n_prompt == 0:
        raise SpecterError(f"{what} is empty: give it some text")
    need = n_prompt + n_predict - 1  # the last generated token is never stored
    if need > ctx_size:
        raise SpecterError(f"{what} ({n_prompt} tokens) and -n {n_predict} need a context of {need} tokens, above "
                           f"-c/--ctx-size {ctx_size}: give a larger -c or a smaller -n")


DRAFT_MATCH = (("arch", "architecture"), ("n_layer", "layers"), ("n_expert", "experts"),
               ("n_expert_used", "experts per token"), ("n_embd", "hidden size"), ("n_ff_exp", "expert width"),
               ("n_vocab", "vocabulary"))


def check_draft(target: GGUFFile, draft: GGUFFile) -> None:
    """`draft` can lend its experts to `target`: the same hyperparameters where they meet (DRAFT_MATCH); else one
    error naming each difference and the fix. Checked from the headers, before either file's weights load."""
    cfg, dcfg = ModelConfig.from_gguf(target), ModelConfig.from_gguf(draft)
    diff = [f"{label} {getattr(dcfg, key)} against {getattr(cfg, key)}" for key, label in DRAFT_MATCH
            if getattr(dcfg, key) != getattr(cfg, key)]
    if diff:
        raise SpecterError(f"{draft.path} is not a draft of {target.path} ({', '.join(diff)}); make one from the "
                           f"model with `specter-gguf quantize MODEL --type q4_k_m` or give --draft a type")


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
    gating = {0: "softmax", 1: "softmax", 2: "sigmoid"}.get(key("expert_gating_func", 0))
    if gating is None:
        raise SpecterError(f"{f.path}: {a}.expert_gating_func {key('expert_gating_func')} is not supported "
                           f"(softmax = 1, sigmoid = 2)")
    kw: dict[str, Any] = dict(
        expert_weights_norm=key("expert_weights_norm", False, bool),
        expert_gating_func=gating,
        n_expert_groups=key("expert_group_count", 0, lo=0, hi=cfg.n_expert),
        n_group_used=key("expert_group_used_count", 0, lo=0, hi=cfg.n_expert),
        rope_scaling=scaling,
        n_ctx_orig_yarn=key("rope.scaling.original_context_length", 0, lo=0) or cfg.n_ctx_train,
    )
    # the attention factor llama.cpp's context passes to every ggml_rope_ext (llama-context.cpp)
    log_mul = key("rope.scaling.yarn_log_multiplier", 0.0, float)
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
    attn_factor *= key("rope.scaling.attn_factor", 1.0, float, lo=0.0)
    kw.update(rope_ext_factor=ext_factor, rope_attn_factor=attn_factor, rope_yarn_log_mul=log_mul)

    if a == "deepseek2":
        n_vocab = cfg.n_vocab
        lite = cfg.n_layer in (26, 27) or (cfg.n_layer == 48 and n_vocab == 128256)  # llama.cpp's is_lite
        k_mla = key("attention.key_length_mla", 0, lo=0, hi=MAX_DIM)
        v_mla = key("attention.value_length_mla", 0, lo=0, hi=MAX_DIM)
        split = k_mla != 0 and v_mla != 0
        head_k = k_mla if split else cfg.head_dim
        head_v = v_mla if split else key("attention.value_length", cfg.head_dim, lo=1, hi=MAX_DIM)
        kw.update(
            n_lora_q=0 if lite else key("attention.q_lora_rank", 0, lo=0, hi=MAX_DIM),
            n_lora_kv=key("attention.kv_lora_rank", lo=1, hi=MAX_DIM),
            head_dim_k_mla=head_k, head_dim_v_mla=head_v, mla_split_kv_b=split,
            n_ff_shexp=cfg.n_ff_exp * cfg.n_expert_shared,
        )
        if head_k - cfg.rope_dim < 1:
            raise SpecterError(f"{f.path}: deepseek2 key length {head_k} leaves no non-rotated dims "
                               f"(rope.dimension_count {cfg.rope_dim})")
    return dataclasses.replace(cfg, **kw)
