"""The draft's expert-id agreement with the target (the paper's Table 1), measured on the tokens each verification
checks, on the device.

Per MoE layer and drafted position, the share of the draft's top-k experts that the target's verification of the
same input token chose too: |draft's ids ∩ target's ids| / k. Draft step j and verification row j read the same
input token at the same position (the iteration's first token, then the drafted ones), so each iteration compares
its k drafted positions, accepted or not. The first MoE layer agrees everywhere by construction: its input comes
from the embedding and attention alone, which the draft shares with the target (also for the keys and values of
the positions the draft wrote itself); the layers after it see what the draft's experts changed.

Two routing observers record the ids on the device: `on_draft` keeps the draft step's ids of every layer in a fixed
buffer (inside a draft step's CUDA graph too), which `drafted(j)` copies into row j after step j is enqueued (the
rows the lookahead buffer counts: `drafted_rows`); `on_verify` keeps the verification's ids of every row.
`compare(k)`, enqueued after the verification, adds the matches into per-layer counters. No tensor is read back
until `read` at the end of a generation: drafting and verification do not wait for the host. One generation at a
time per decoder, as for the lookahead buffer: two generations iterated together would count into the same buffers.
"""

from __future__ import annotations

import torch

from specter_gguf.layers import MoE, RoutingObserver, Transformer


class Observers:
    """Several routing observers as one (None entries skipped)."""

    def __init__(self, *observers: RoutingObserver | None) -> None:
        self.observers = [o for o in observers if o is not None]

    def __call__(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        for o in self.observers:
            o(layer, ids, weights)


class RoutingAgreement:
    """Counts, per MoE layer, the draft's chosen experts that the target chose too, over verified positions."""

    def __init__(self, n_layer: int, k: int, moe_layers: list[int], device: torch.device, depth: int) -> None:
        """`depth`: the most tokens an iteration drafts."""
        L = n_layer
        self.k, self.moe_layers, self.depth = k, moe_layers, depth
        self._step = torch.zeros((L, k), dtype=torch.int32, device=device)                # the last draft step
        self._drafted = torch.zeros((depth, L, k), dtype=torch.int32, device=device)       # row j: draft step j
        self._verified = torch.zeros((L, depth + 1, k), dtype=torch.int32, device=device)
        self._matches = torch.zeros(L, dtype=torch.int64, device=device)
        self.positions = 0  # drafted positions compared (host-side count)

    @classmethod
    def of(cls, transformer: Transformer, device: torch.device, depth: int) -> RoutingAgreement:
        cfg = transformer.config
        return cls(cfg.n_layer, cfg.n_expert_used, [b.layer for b in transformer.blocks if isinstance(b.ffn, MoE)],
                   device, depth)

    def reset(self) -> None:
        """A new generation: nothing compared yet."""
        self._matches.zero_()
        self.positions = 0

    def on_draft(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._step[layer].copy_(ids[0])

    def on_verify(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._verified[layer, :ids.shape[0]].copy_(ids)

    def drafted(self, j: int) -> None:
        """Draft step j has been enqueued: keep its routing as row j."""
        self._drafted[j].copy_(self._step)

    def drafted_rows(self, n: int) -> torch.Tensor:
        """The routing of draft steps 0..n-1 of this iteration, [n, n_layer, top_k] (rows of dense layers unused)."""
        return self._drafted[:n]

    def compare(self, k: int) -> None:
        """The verification of k drafted tokens has been enqueued: count its rows 0..k-1 against the draft's."""
        draft = self._drafted[:k]                           # [k, L, top-k]
        target = self._verified[:, :k].transpose(0, 1)      # [k, L, top-k]
        same = (draft[..., :, None] == target[..., None, :]).any(-1).sum(-1)  # [k, L]
        self._matches += same.sum(0)
        self.positions += k

    def read(self) -> tuple[float | None, list[float | None]]:
        """The agreement over every MoE layer and per layer (None for a dense layer, or before any comparison);
        reads the device once."""
        if not self.positions:
            return None, [None] * len(self._matches)
        matches = self._matches.tolist()
        per_layer = [m / (self.positions * self.k) if i in self.moe_layers else None for i, m in enumerate(matches)]
        overall = sum(matches[i] for i in self.moe_layers) / (self.positions * self.k * len(self.moe_layers))
        return overall, per_layer
