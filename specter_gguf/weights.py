"""GGUF tensors as torch tensors on the compute device.

Storage policy (one copy of each weight, chosen for the device):
- CPU: every tensor is a zero-copy view of the memory-mapped file: F32 tensors (and 1-D F16/BF16 ones) as torch
  tensors, quantized tensors and F16/BF16 matrices as a `QuantizedTensor` of the file's bytes.
- CUDA: F16 stays float16, BF16 bfloat16, F32 float32; quantized tensors are copied as they are (a
  `QuantizedTensor` on the device): GPU memory of a quantized model is about its file size. The native
  kernels (`specter_gguf.kernels`) compute with them in their GGUF encoding. Where the experts are offloaded, the
  token embedding is the exception: a `QuantizedTensor` in pinned host memory (`load_pinned`), read in place.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from specter_gguf.gguf_file import GGUFTensor
from specter_gguf.kernels import QuantizedTensor


def mapped_view(t: GGUFTensor) -> torch.Tensor:
    """A zero-copy torch view of a float tensor (F32, F16, BF16) in the memory-mapped file."""
    data = t.data.view(np.uint16) if t.type == T.BF16 else t.data
    with warnings.catch_warnings():  # the mapping is read-only and weights are never written
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(data)
    if t.type == T.BF16:
        view = view.view(torch.bfloat16)
    return view.reshape(t.shape)


def load_tensor(t: GGUFTensor, device: torch.device) -> torch.Tensor | QuantizedTensor:
    """`t` on `device` in its storage form (see the module docstring)."""
    if t.type == T.F32 or (t.type in (T.F16, T.BF16) and (device.type != "cpu" or len(t.shape) == 1)):
        view = mapped_view(t)
        return view if device.type == "cpu" else view.to(device)
    # quantized tensors, and F16/BF16 matrices on the CPU, where the native kernels read half floats directly
    # (torch would convert the whole matrix to float32 on every product)
    q = QuantizedTensor.from_numpy(t.data, int(t.type), t.shape)
    return q if device.type == "cpu" else q.to(device)


def load_pinned(t: GGUFTensor) -> QuantizedTensor:
    """`t` in its file encoding (any type, float ones included) in pinned host memory: rows that a CUDA kernel reads
    in place over PCIe (`QuantizedTensor.rows(ids, device)`), without a copy on the device."""
    mapped = QuantizedTensor.from_numpy(t.data, int(t.type), t.shape)
    return QuantizedTensor(mapped.data.pin_memory(), mapped.ggml_type, mapped.shape)
