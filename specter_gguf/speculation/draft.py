"""The draft: a quantized copy of the target's routed experts, resident on the device.

It is not a second model. A draft GGUF (e.g. `specter-gguf quantize MODEL.gguf --type q4_k_m`) gives only its
routed experts; drafting runs the target's own transformer with them (`Transformer.forward(experts=...)`), so
attention, norms, routers, shared experts and the KV cache are the target's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specter_gguf.gguf_file import GGUFFile, expert_tensor_name
from specter_gguf.layers import Experts, MoE, ResidentExperts
from specter_gguf.weights import load_tensor

if TYPE_CHECKING:
    from specter_gguf.engine import Model


def load_draft_experts(draft: GGUFFile, target: Model) -> list[Experts | None]:
    """The routed experts of every MoE layer of `target`, from `draft` (a quantized copy of the target file),
    resident on the target's device; None for layers without routed experts."""
    cfg = target.config  # the draft's hyperparameters were checked against it (config.check_draft) before loading
    e, f, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    experts: list[Experts | None] = []
    for i, block in enumerate(target.transformer.blocks):
        if not isinstance(block.ffn, MoE):
            experts.append(None)
            continue
        w = {name: load_tensor(draft.tensor(expert_tensor_name(i, name), shape), target.device)
             for name, shape in (("gate", (e, f, d)), ("up", (e, f, d)), ("down", (e, d, f)))}
        experts.append(ResidentExperts(**w))
    return experts
