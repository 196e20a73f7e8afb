"""What the GPU tests share: the native CUDA build check and the device's memory state around a measurement."""

from __future__ import annotations

import gc

import pytest
import torch


def require_native_cuda() -> None:
    from specter_gguf import native

    if not native.has_cuda():
        pytest.skip("the native library was built without CUDA (cmake -DSPECTER_CUDA=ON)")


def free_device() -> None:
    """Release what the caching allocator holds of tensors no longer referenced."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def warm_up() -> None:
    """Create the CUDA context, cuBLAS handle and workspace before measuring (counted apart from the workspace)."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    (a @ a).sum().item()
    free_device()

