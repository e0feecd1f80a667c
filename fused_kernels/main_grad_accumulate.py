"""``main_grad += grad`` for an fp32 ``main_grad`` and a bf16/fp16 gradient, as one Triton kernel.

Why: megatron's DDP adds each weight gradient into its fp32 ``main_grad`` with ``add_``, and
torch runs an fp32 += bf16 add through its type-casting loop, which reaches well under the
copy bandwidth; with billions of (mostly routed-expert) parameters in the 35B-A3B model that
add is a visible share of the step (profile in docs/moe.md). Here each program loads a block of
both, upcasts the gradient and stores the sum: 10 bytes per element, nothing else.

The sum is the same fp32 addition of the same (exactly upcast) values as the reference
``main.add_(grad)``, so the result is bit-identical.
"""

from __future__ import annotations

import functools
import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the reference still works
    triton = None

from fused_kernels.triton_support import unavailable_reason  # noqa: E402

log = logging.getLogger(__name__)

BLOCK = 4096  # elements per program (16 per thread at 8 warps: 16-byte fp32 stores, 32-byte bf16 loads)


def accumulate_reference(main: torch.Tensor, grad: torch.Tensor) -> None:
    main.add_(grad)


def available(main: torch.Tensor, grad: torch.Tensor) -> str | None:
    """None when the kernel can add ``grad`` into ``main``, else the reason."""
    if main.dtype != torch.float32:
        return f"main_grad dtype {main.dtype} is not fp32"
    if main.shape != grad.shape:
        return f"shapes differ ({tuple(main.shape)} vs {tuple(grad.shape)})"
    if not (main.is_contiguous() and grad.is_contiguous()):
        return "a tensor is not contiguous"
    if main.device != grad.device:
        return "tensors on different devices"
    return unavailable_reason(grad)


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("main_grad accumulate: Triton kernel not used (%s); using torch's add_", reason)


def accumulate_(main: torch.Tensor, grad: torch.Tensor) -> None:
    """``main += grad`` in place: the Triton kernel where it can run, else ``add_`` (warned once)."""
    reason = available(main, grad)
    if reason is not None:
        if main.is_cuda:  # on the CPU add_ is the only path, nothing to warn about
            _warn_fallback(reason)
        accumulate_reference(main, grad)
        return
    n = main.numel()
    if n:
        _accumulate_kernel[(triton.cdiv(n, BLOCK),)](main, grad, n, BLOCK=BLOCK, num_warps=8)


if triton is not None:

    @triton.jit
    def _accumulate_kernel(main_ptr, grad_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        m = tl.load(main_ptr + offs, mask=mask)
        g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
        tl.store(main_ptr + offs, m + g, mask=mask)
