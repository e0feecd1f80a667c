"""Grouped matrix multiply for MoE experts: ``torch._grouped_mm`` where it runs, a loop elsewhere.

Two shapes, both with ``offs`` the int32 end offset of each group (``cumsum(tokens_per_expert)``):
- ``a`` [N, K] x ``b`` [G, K, M] -> [N, M]: rows offs[g-1]:offs[g] of ``a`` times ``b[g]``
  (the forward and the input gradient of each expert's linear layer);
- ``a`` [K, N] x ``b`` [N, M] -> [G, K, M]: group g is ``a[:, rows] @ b[rows]`` over its rows
  (the weight gradient). An empty group gives zeros (checked on the GPU by
  tests/gpu/test_grouped_experts_gpu.py, which fails if torch's kernel ever leaves it unwritten).

The fast path is torch's grouped GEMM (CUTLASS, one launch for all groups, offsets read on the
device, so no host sync): CUDA, compute capability >= 9.0, bf16. ``grouped_mm_reference`` is the
plain per-group definition the tests check it against; it reads the offsets on the host. The
fast path falls back to it with one warning naming the reason.
"""

from __future__ import annotations

import functools
import logging

import torch

from core.devices import hopper_reason

log = logging.getLogger(__name__)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group matmuls in a's dtype (fp32 accumulation as torch.matmul does)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # [N, K] x [G, K, M]
        out = a.new_empty(a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                torch.matmul(a[s:e], b[g], out=out[s:e])
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[-1])  # [K, N] x [N, M] -> [G, K, M]
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            torch.matmul(a[:, s:e], b[s:e], out=out[g])
    return out


def available(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when torch's grouped GEMM takes these operands, else the reason."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (needs >= 2.8)"
    unsupported = hopper_reason(a.device, "the grouped GEMM")
    if unsupported:
        return unsupported
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return f"dtypes {a.dtype} x {b.dtype}; the grouped GEMM runs bf16"
    return None


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("MoE experts: torch._grouped_mm not used (%s); running one matmul per expert, "
                "with a host sync per call", reason)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    reason = available(a, b)
    if reason is not None:
        _warn_fallback(reason)
        return grouped_mm_reference(a, b, offs)
    # An empty group of the weight-gradient form comes back as zeros (torch 2.11 on an H200,
    # tests/gpu/test_grouped_experts_gpu.py: torch_zeroes_empty_wgrad_groups), so no mask pass.
    return torch._grouped_mm(a, b, offs=offs)
