"""The expert lookahead buffer (Specter's ELB): while the draft speculates, the experts its routers choose are
handed to the target's expert cache, so the copies the verification pass needs run during drafting.

Register an `ExpertLookahead` as a routing observer for the draft passes; after each draft pass `flush()` reads
that pass's expert ids back (one deliberate host synchronisation per drafted token: the host decides what to
copy) and asks the cache to make them resident, earliest layer first (verification runs the layers in order),
each layer's experts in the order the draft chose them. The copies are queued on the copy stream and return
at once; the verification pass waits only for the ones it reaches before they land.
"""

from __future__ import annotations

import torch

from specter_gguf.runtime.cache import ExpertCache


class ExpertLookahead:
    """A routing observer collecting the draft's (layer, expert) choices for `cache`."""

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache
        self._routed: list[tuple[int, torch.Tensor]] = []

    def __call__(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._routed.append((layer, ids.reshape(-1)))

    def flush(self) -> int:
        """Request the experts routed since the last flush; returns the number of copies issued."""
        if not self._routed:
            return 0
        flat = torch.cat([ids for _, ids in self._routed]).tolist()  # HOST SYNC (deliberate), once per pass
        per_layer: dict[int, list[int]] = {}
        start = 0
        for layer, ids in self._routed:
            per_layer.setdefault(layer, []).extend(flat[start:start + ids.numel()])
            start += ids.numel()
        self._routed.clear()
        keys = [(layer, e) for layer in sorted(per_layer) for e in dict.fromkeys(per_layer[layer])]
        return self.cache.request(keys)
