"""What the fused Triton kernels share: interpreter / autotune switches, the bucketed cu_seqlens
width, and the checks every kernel makes before it runs."""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # CPU-only installs without triton: the references still work
    triton = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotuning() -> bool:
    """FUSED_KERNELS_AUTOTUNE=0 pins one config: parity runs compile many shapes and need no tuning."""
    return not interpreting() and os.environ.get("FUSED_KERNELS_AUTOTUNE", "1") != "0"


def cu_block(n_cu: int) -> int:
    """Width of the cu_seqlens search, a compile-time constant. Bucketed (at least 64) so that the
    number of packed samples, which changes every batch, does not trigger a recompile (and, with
    autotuning, a re-benchmark) of every kernel: that cost 2x end to end on the 2B recipe."""
    return max(64, triton.next_power_of_2(n_cu))


def cu_steps(n_cu: int) -> int:
    """Iterations of a binary search over ``n_cu`` sorted offsets, bucketed like ``cu_block``."""
    return cu_block(n_cu).bit_length() - 1


def unavailable_reason(x: torch.Tensor) -> str | None:
    """The checks every fused kernel shares: Triton present, a CUDA tensor (or the interpreter), a
    float dtype. None when they pass, else the reason for the fallback warning."""
    if triton is None:
        return "triton is not installed"
    if not x.is_cuda and not interpreting():
        return "tensor is not on a CUDA device (set TRITON_INTERPRET=1 to run Triton on CPU)"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} is not fp32/bf16/fp16"
    return None
