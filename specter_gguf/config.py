"""Model hyperparameters read from GGUF metadata, as llama.cpp reads them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile


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
        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        n_expert_used = int(key("expert_used_count"))
        n_ff = int(key("feed_forward_length", 0))
        n_vocab = len(f.get("tokenizer.ggml.tokens", [])) or f.tensor("token_embd.weight").shape[0]
        scaling = str(f.get(f"{a}.rope.scaling.type", "none"))
        factor = float(f.get(f"{a}.rope.scaling.factor", 0.0) or 0.0)
        if scaling not in ("none", "linear") and factor not in (0.0, 1.0):
            raise SpecterError(f"{f.path}: RoPE scaling '{scaling}' is not supported for '{a}' yet; "
                               f"remove {a}.rope.scaling.* from the file to run it at its original context")
        return cls(
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
            rope_freq_scale=1.0 / factor if scaling == "linear" and factor > 0 else 1.0,
            n_ff=n_ff,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_expert_shared=int(key("expert_shared_count", 0)),
            n_ff_exp=int(key("expert_feed_forward_length", 0)) or _default_expert_width(a, n_ff, n_expert_used),
            n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)) or n_ff,
            expert_weights_scale=float(key("expert_weights_scale", 0.0)),
            n_leading_dense=int(key("leading_dense_block_count", 0)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _default_expert_width(arch: str, n_ff: int, n_expert_used: int) -> int:
    """llama.cpp's fallback when `expert_feed_forward_length` is absent: Qwen files split the FFN width over
    the used experts; Mixtral and OLMoE store the expert width as `feed_forward_length`."""
    return n_ff // max(n_expert_used, 1) if arch in ("qwen2moe", "qwen3moe") else n_ff
