"""Random GGUF weight data for the kernel benchmarks (scripts/bench_kernels.py, scripts/bench_cpu_experts.py):
valid quants and small finite scales, so that every product stays finite."""

from __future__ import annotations

import torch

from specter_gguf import native
from specter_gguf.kernels import QuantizedTensor

# byte offsets of the fp16 scales inside a block of each quantized type (IQ1_M's d is the top nibbles of its four
# 16-bit scale words, bytes 48..55)
SCALE_FIELDS = {native.Q8_0: (0,), native.Q4_0: (0,), native.Q4_1: (0, 2), native.Q5_0: (0,), native.Q5_1: (0, 2),
                native.Q2_K: (80, 82), native.Q3_K: (108,),
                native.Q4_K: (0, 2), native.Q5_K: (0, 2), native.Q6_K: (208,), native.IQ4_NL: (0,), native.IQ4_XS: (0,),
                native.IQ1_S: (0,), native.IQ1_M: (), native.IQ2_XXS: (0,), native.IQ2_XS: (0,), native.IQ2_S: (0,),
                native.IQ3_XXS: (0,), native.IQ3_S: (0,)}


def random_weight(ggml_type: int, rows: int, cols: int, device: torch.device | str,
                  generator: torch.Generator | None = None) -> QuantizedTensor:
    """A [rows, cols] matrix of `ggml_type` made on `device` (F16/BF16: normal values of scale 0.02; quantized
    types: random quants, fp16 scales in [1e-3, 4e-3)); `generator`, when given, lives on `device`."""
    if ggml_type in (native.F16, native.BF16):
        dt = torch.float16 if ggml_type == native.F16 else torch.bfloat16
        raw = (torch.randn(rows, cols, device=device, generator=generator) * 0.02).to(dt).view(torch.uint8)
        return QuantizedTensor(raw.reshape(-1), ggml_type, (rows, cols))
    elems, nbytes = native.block_size(ggml_type)
    nblocks = rows * cols // elems
    raw = torch.randint(0, 256, (nblocks, nbytes), dtype=torch.uint8, device=device, generator=generator)
    for off in SCALE_FIELDS[ggml_type]:
        scale = (torch.rand(nblocks, device=device, generator=generator) * 3e-3 + 1e-3).half()
        raw[:, off:off + 2] = scale.view(torch.uint8).reshape(nblocks, 2)
    if ggml_type == native.IQ1_M:
        d = (torch.rand(nblocks, device=device, generator=generator) * 3e-3 + 1e-3).half().view(torch.int16).int()
        words = raw[:, 48:56].contiguous().view(torch.int16).int() & 0x0FFF
        for i in range(4):
            words[:, i] |= ((d >> (4 * i)) & 0xF) << 12
        raw[:, 48:56] = words.short().view(torch.uint8)
    return QuantizedTensor(raw.reshape(-1), ggml_type, (rows, cols))
