"""ExpertStore: the target's routed experts in host memory, one contiguous gate|up|down record per
(layer, expert), so that one copy moves one expert.

- CUDA: each layer's records live in one pinned (page-locked) buffer `[n_expert, record_bytes]` — pageable
  memory copies at ~6.5 GB/s against ~55 GB/s pinned. Records keep the GGUF type of the file (a quantized
  target moves fewer bytes). Layers are pinned lazily: a background thread pins them
  in order from the start, and a layer needed before the thread got there is pinned on first use, so
  start-up does not wait for the whole store.
- CPU: the store *is* the memory-mapped file: no copy; a record is its three part views (the "copy" into a
  slot is then a memcpy of three pieces).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from specter_gguf.gguf_file import GGUFFile, expert_tensor_name
from specter_gguf.runtime.budget import RecordLayout

Chunk = tuple[int, 'torch.Tensor | np.ndarray']  # (byte offset in the record, uint8 bytes)


def _bytes_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class ExpertStore:
    def __init__(self, f: GGUFFile, layouts: dict[int, RecordLayout], n_expert: int, device: torch.device,
                 pin: str = "background", progress: bool = True) -> None:
        """`pin`: "background" (a thread pins every layer in order; first use pins a layer not reached yet),
        "lazy" (first use only) or "eager" (all now, with a progress bar). Ignored on the CPU."""
        if pin not in ("background", "lazy", "eager"):
            raise ValueError(f"pin must be background, lazy or eager, not {pin!r}")
        self.f, self.layouts, self.n_expert = f, layouts, n_expert
        self.pinned = device.type == "cuda"
        self._buffers: dict[int, torch.Tensor] = {}
        self._locks = {layer: threading.Lock() for layer in layouts}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.host_bytes = sum(r.nbytes * n_expert for r in layouts.values()) if self.pinned else 0
        if not self.pinned:
            return
        self._bar = tqdm(total=self.host_bytes, unit="B", unit_scale=True, desc="pinning experts",
                         disable=not progress, leave=False, delay=0.5)
        if pin == "eager":
            for layer in layouts:
                self.ensure(layer)
            self._bar.close()
        elif pin == "background":
            self._thread = threading.Thread(target=self._pin_all, name="specter-expert-store", daemon=True)
            self._thread.start()

    # -- pinning -----------------------------------------------------------------------------------------
    def _pin_all(self) -> None:
        try:
            for layer in self.layouts:
                if self._stop.is_set():
                    return
                self.ensure(layer)
        except BaseException as e:  # reported by the next ensure() of the decode path
            self._error = e
        finally:
            self._bar.close()

    def ensure(self, layer: int) -> None:
        """Make `layer`'s records available (pins them now if the background thread has not yet)."""
        if not self.pinned or layer in self._buffers:
            return
        if self._error is not None:
            raise self._error
        with self._locks[layer]:
            if layer in self._buffers:
                return
            layout = self.layouts[layer]
            buf = torch.empty((self.n_expert, layout.nbytes), dtype=torch.uint8, pin_memory=True)
            out = buf.numpy()
            for part in layout.parts:
                t = self.f.tensor(expert_tensor_name(layer, part.name))
                for e in range(self.n_expert):
                    out[e, part.offset:part.offset + part.nbytes] = _bytes_of(t.data[e])
                self._bar.update(part.nbytes * self.n_expert)
            self._buffers[layer] = buf

    def wait(self) -> None:
        """Block until every layer is pinned (tests, benchmarks that exclude start-up)."""
        for layer in self.layouts:
            self.ensure(layer)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # -- records -----------------------------------------------------------------------------------------
    def chunks(self, layer: int, expert: int) -> Sequence[Chunk]:
        """The record of (layer, expert) as (offset, bytes) pieces: one pinned uint8 tensor on CUDA, three
        numpy views of the memory-mapped file on the CPU."""
        if self.pinned:
            self.ensure(layer)
            return ((0, self._buffers[layer][expert]),)
        out = []
        for part in self.layouts[layer].parts:
            t = self.f.tensor(expert_tensor_name(layer, part.name))
            out.append((part.offset, _bytes_of(t.data[expert])))  # a view of the mapping: no copy
        return out

    def copy_us(self, layer: int, device: torch.device, reps: int = 8) -> float:
        """Device time in µs of copying one record of `layer` (expert 0) into `device`'s memory: the mean of `reps`
        copies after a warm-up, timed by CUDA events. CUDA only."""
        record = self.chunks(layer, 0)[0][1]
        slot = torch.empty_like(record, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        slot.copy_(record, non_blocking=True)  # warm-up
        start.record()
        for _ in range(reps):
            slot.copy_(record, non_blocking=True)
        end.record()
        end.synchronize()
        return 1000 * start.elapsed_time(end) / reps

    def addresses(self, layer: int) -> list[list[int]]:
        """Host addresses of every expert's gate, up and down matrices of `layer`, `[part][expert]`: pinned memory
        that a CUDA kernel reads in place (host allocations are mapped into the device's address space under
        unified addressing, at the same address), or the memory-mapped file on the CPU."""
        layout = self.layouts[layer]
        if self.pinned:
            self.ensure(layer)
            base = self._buffers[layer].data_ptr()
            return [[base + e * layout.nbytes + p.offset for e in range(self.n_expert)] for p in layout.parts]
        out = []
        for p in layout.parts:
            base = self.f.tensor(expert_tensor_name(layer, p.name)).data.ctypes.data
            out.append([base + e * p.nbytes for e in range(self.n_expert)])
        return out
