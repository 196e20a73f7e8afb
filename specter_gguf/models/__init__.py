"""Architectures: each module builds one transformer block of its architecture from shared layers.

`load_transformer` reads the file's common tensors (embedding, final norm, LM head), asks the architecture's
module for each block, and checks every tensor's presence, type and shape against the metadata first.
"""

from __future__ import annotations

from types import ModuleType

import torch
from tqdm import tqdm

from specter_gguf.config import ModelConfig
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.layers import Embedding, Linear, RMSNorm, Transformer
from specter_gguf.models import deepseek2, mixtral, olmoe, phimoe, qwen2moe, qwen3moe
from specter_gguf.models.common import ExpertsFactory, Weights
from specter_gguf.weights import load_pinned

ARCHITECTURES: dict[str, ModuleType] = {"qwen2moe": qwen2moe, "qwen3moe": qwen3moe, "llama": mixtral,
                                        "olmoe": olmoe, "deepseek2": deepseek2, "phimoe": phimoe}


def check_architecture(f: GGUFFile) -> ModuleType:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise SpecterError(f"{f.path}: architecture '{arch}' is not supported; supported: "
                           f"{', '.join(sorted(ARCHITECTURES))} (GGUF general.architecture)")
    return ARCHITECTURES[arch]


def load_transformer(f: GGUFFile, device: torch.device, progress: bool = True,
                     make_experts: ExpertsFactory | None = None, host_embedding: bool = False) -> Transformer:
    """The file's transformer on `device`; `make_experts` places the routed experts (default: on the device).
    `host_embedding` (offloaded experts on CUDA, an LM head of its own): the token embedding stays in pinned host
    memory (`layers.Embedding`)."""
    module = check_architecture(f)
    cfg = ModelConfig.from_gguf(f)
    total = sum(t.n_bytes for t in f.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress,
              leave=False, delay=0.5) as bar:  # shown only when loading takes a while
        w = Weights(f, device, bar, make_experts)
        output = w("output.weight", (cfg.n_vocab, cfg.n_embd), optional=True)
        if host_embedding and output is not None:
            embedded = f.tensor("token_embd.weight", (cfg.n_vocab, cfg.n_embd))
            bar.update(embedded.n_bytes)
            embedding = Embedding(load_pinned(embedded), output.device)
        else:
            token_embd = w("token_embd.weight", (cfg.n_vocab, cfg.n_embd))
            embedding = Embedding(token_embd, token_embd.device)
        model = Transformer(
            config=cfg,
            embedding=embedding,
            blocks=[],
            output_norm=RMSNorm(w("output_norm.weight", (cfg.n_embd,)), cfg.rms_eps,
                                w("output_norm.bias", (cfg.n_embd,), optional=True)),  # bias: phimoe
            output=Linear(embedding.weight if output is None else output,  # tied embeddings when absent
                          w("output.bias", (cfg.n_vocab,), optional=True)),
        )
        model.blocks = [module.build_block(cfg, i, w.layer(i)) for i in range(cfg.n_layer)]
    return model
