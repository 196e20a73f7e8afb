"""Q8_0 quantization as the writer does it, slab by slab where the values are generated: the blocks are bit for
bit what ``gguf.quants.quantize(x, Q8_0)`` (= ggml's ``quantize_row_q8_0_ref``) gives for the same float32 values;
:func:`q8_0_blocks` does the same arithmetic vectorized in torch, on the generating device (measured on the 16-core
H200 machine: 850 M values/s on the CPU, 7x gguf's 125)."""

from __future__ import annotations

from typing import Any

import numpy as np

from specter_gguf.errors import SpecterError

Q8_0_BLOCK = 32  # values per Q8_0 block; a block is one f16 scale + 32 int8 (34 bytes)
_Q8_0_CHUNK_BLOCKS = 1 << 17  # blocks quantized at once on the CPU (4 M values, 16 MB: stays in cache)


def q8_0_blocks(x: Any) -> Any:
    """Q8_0 blocks of a float32 torch tensor, on its device: uint8 of shape (*x.shape[:-1], x.shape[-1] // 32 *
    34), the bytes llama.cpp stores (per block of 32 values along the last dimension: f16 d = amax / 127, then
    int8 q = roundf(x / d), computed as x * (1 / d) with d in float32, as ggml's quantize_row_q8_0_ref and
    gguf.quants do). Bit-identical to ``gguf.quants.quantize(x, Q8_0)``; the last dimension must be a
    multiple of 32. On the CPU it works through cache-sized chunks (faster than whole-slab passes)."""
    import torch

    if x.ndim == 0 or x.shape[-1] % Q8_0_BLOCK:
        raise SpecterError(f"Q8_0 needs rows that are a multiple of {Q8_0_BLOCK} values, got {tuple(x.shape)}")
    blocks = x.to(torch.float32).reshape(-1, Q8_0_BLOCK)
    out = torch.empty((blocks.shape[0], 2 + Q8_0_BLOCK), dtype=torch.uint8, device=x.device)
    step = _Q8_0_CHUNK_BLOCKS if x.device.type == "cpu" else max(1, blocks.shape[0])
    for i in range(0, blocks.shape[0], step):
        b = blocks[i:i + step]
        d = b.abs().amax(dim=1, keepdim=True)
        # true divisions: CUDA turns a division by a scalar into a multiplication by its reciprocal
        d = d.div_(torch.full_like(d, 127.0))
        inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d).div_(d))
        v = b * inv
        s = v.sign()
        a = v.abs_()
        f = a.floor()
        q = a.sub_(f).mul_(2).floor_().add_(f).mul_(s)  # roundf (half away from zero), as gguf's np_roundf
        out[i:i + step, :2] = d.to(torch.float16).view(torch.uint8)
        out[i:i + step, 2:] = q.to(torch.int8).view(torch.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // Q8_0_BLOCK * (2 + Q8_0_BLOCK))


def quantize_q8_0(a: np.ndarray) -> np.ndarray:
    """Numpy in, numpy out: :func:`q8_0_blocks` of `a` (as float32), equal to gguf.quants.quantize(a, Q8_0)."""
    import torch

    return q8_0_blocks(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))).numpy()
