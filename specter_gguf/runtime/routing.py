"""Routing hooks: what the MoE layers chose, gathered without host synchronisation.

`DeviceRoutingCounts` is a `RoutingObserver` (pass it to a forward, or set it as `Model.routing_observer`): it
adds each layer's selected expert ids into a `[n_layer, n_expert]` counts tensor on the compute device with
`index_add_` — no host sync per layer, nothing read back until someone asks (`profile`: a routing profile).

`RoutingProfile` is the host-side result of a profiling run: counts per (layer, expert), saved and loaded as
JSON, used by the static-hot cache policy.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from specter_gguf.errors import SpecterError

log = logging.getLogger(__name__)

PROFILE_FORMAT = "specter-gguf routing profile v1"


class DeviceRoutingCounts:
    """Per-(layer, expert) counts of routed tokens, accumulated on the device."""

    def __init__(self, n_layer: int, n_expert: int, device: torch.device | str) -> None:
        self.n_layer, self.n_expert = n_layer, n_expert
        self.counts = torch.zeros((n_layer, n_expert), dtype=torch.int32, device=device)

    def __call__(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        # enqueued on the compute stream like the layer itself: no host synchronisation
        self.counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def profile(self) -> RoutingProfile:
        """The counts as a host-side profile (reads the device: a host synchronisation, once)."""
        counts = self.counts.cpu().tolist()
        return RoutingProfile({(i, e): int(c) for i, row in enumerate(counts) for e, c in enumerate(row) if c})


class RoutingProfile:
    """Counts per (layer, expert) from a profiling run."""

    def __init__(self, counts: dict[tuple[int, int], int], model: str = "") -> None:
        self.counts, self.model = dict(counts), model

    def check(self, path: str, n_layer: int, n_expert: int, where: str) -> None:
        """Fails unless every (layer, expert) counted exists in the model of file `path` (`n_layer` layers of
        `n_expert` experts) and every count is positive; warns when the profile names another file."""
        for (layer, expert), c in sorted(self.counts.items()):
            if not (0 <= layer < n_layer and 0 <= expert < n_expert) or c < 0:
                raise SpecterError(f"{where}: {c} uses of expert {expert} of layer {layer}, which {Path(path).name} "
                                   f"({n_layer} layers of {n_expert} experts) cannot have: the profile is of another "
                                   f"model; record one with `specter-gguf run {Path(path).name} "
                                   "--save-routing-profile FILE`")
        if self.model and Path(self.model).name != Path(path).name:
            log.warning("%s was recorded with %s, not %s: its hot experts may not be this model's", where,
                        Path(self.model).name, Path(path).name)

    def count(self, key: tuple[int, int] | None) -> int:
        return self.counts.get(key, 0) if key is not None else 0

    def hottest(self) -> list[tuple[int, int]]:
        """Keys by descending count (ties: layer, expert order)."""
        return sorted(self.counts, key=lambda k: (-self.counts[k], k))

    def save(self, path: str | os.PathLike[str]) -> None:
        layers: dict[str, dict[str, int]] = {}
        for (layer, expert), c in sorted(self.counts.items()):
            layers.setdefault(str(layer), {})[str(expert)] = c
        Path(path).write_text(json.dumps({"format": PROFILE_FORMAT, "model": self.model, "counts": layers},
                                         indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingProfile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if data.get("format") != PROFILE_FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {PROFILE_FORMAT!r}")
            counts = {(int(layer), int(e)): int(c) for layer, row in data["counts"].items() for e, c in row.items()}
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise SpecterError(f"{path}: not a routing profile ({e}); write one with "
                               f"`specter-gguf run ... --save-routing-profile PROFILE.json`") from None
        return cls(counts, data.get("model", ""))
