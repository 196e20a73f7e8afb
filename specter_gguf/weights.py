"""GGUF tensors as torch tensors on the compute device.

Storage policy (one copy of each weight, chosen for the device):
- CPU: F32/F16/BF16 tensors are zero-copy views of the memory-mapped file; quantized tensors are dequantized
  once to float32 (the native kernels issue keeps them quantized).
- CUDA: F16 stays float16, BF16 bfloat16, F32 float32; quantized tensors are dequantized to float16,
  expert by expert, so host memory holds at most one expert's float32 rows at a time.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from specter_gguf import native
from specter_gguf.gguf_file import GGUFTensor


def mapped_view(t: GGUFTensor) -> torch.Tensor:
    """A zero-copy torch view of a float tensor (F32, F16, BF16) in the memory-mapped file."""
    data = t.data.view(np.uint16) if t.type == T.BF16 else t.data
    with warnings.catch_warnings():  # the mapping is read-only and weights are never written
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(data)
    if t.type == T.BF16:
        view = view.view(torch.bfloat16)
    return view.reshape(t.shape)


def dequantize(t: GGUFTensor, first: int = 0, count: int | None = None) -> torch.Tensor:
    """float32 values of rows `first:first+count` along the leading dimension of a quantized tensor."""
    rows = t.data[first:None if count is None else first + count]
    return torch.from_numpy(native.dequantize(rows, int(t.type), (rows.shape[0], *t.shape[1:])))


def load_tensor(t: GGUFTensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` in its storage dtype (see the module docstring)."""
    if t.type in (T.F32, T.F16, T.BF16):
        view = mapped_view(t)
        return view if device.type == "cpu" else view.to(device)
    if device.type == "cpu":
        return dequantize(t)
    out = torch.empty(t.shape, dtype=torch.float16, device=device)
    step = 1 if len(t.shape) == 3 else max(1, (64 << 20) // (4 * t.shape[-1]))  # an expert, or 64 MiB of rows
    for first in range(0, t.shape[0], step):
        out[first:first + step] = dequantize(t, first, step).to(device, torch.float16)
    return out
