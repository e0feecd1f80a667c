"""FP8's rowwise scaling (one power-of-two scale per row along a GEMM's contraction) in Triton, with
plain PyTorch references.

Compiled by inductor, these casts were most of an FP8 experts layer at a quarter to a half of the
memory bandwidth (docs/fp8.md, "One experts layer"), each call behind dynamo's guards. Two forms:

- ``cast_rows``: x [N, C] with one scale per row (the amax along C): a token's features, a
  weight's output row, and an expert weight whose contraction is its contiguous dimension. One
  program takes a block of rows, reads them once for the amax and again (from cache) for the cast.
- ``cast_columns``: x [G, K, M] with one scale per (g, m) (the amax along K), written column-major
  ([G, M, K] in memory: what torch's grouped FP8 GEMM takes as its second operand): the experts'
  weights in the input gradient's GEMMs, whose contraction is not their contiguous dimension.

Each computes its scales itself: ``fp8_max / amax`` with torch's two roundings (a reciprocal, then a
product), rounded down to a power of two by masking the mantissa off. torch's reference takes
``exp2(floor(log2(scale)))``, which agrees for every amax a bf16 tensor can have below 1.4e38 (the
test checks all of them). When an amax is all-reduced over a tensor-parallel group first, the
``*_amax`` functions give it and the casts take it (``amax=``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the references still work
    triton = None

from fused_kernels.triton_support import unavailable_reason  # noqa: E402

AMAX_FLOOR = 1e-12  # an all-zero row gets a finite scale (its quantized values stay zero)
ROWS_BLOCK_ROWS = 8
ROWS_BLOCK_COLS = 256
COLS_BLOCK_K = 64
COLS_BLOCK_M = 64


def available(x: torch.Tensor) -> str | None:
    """None when the kernels can quantize ``x``, else the reason."""
    return unavailable_reason(x)


# ----------------------------------------------------------------------------- references


def pow2_scales_reference(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest power of two not above ``fp8_max / amax``, and its reciprocal (exact)."""
    scale = torch.finfo(dtype).max / amax.clamp(min=AMAX_FLOOR)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale, scale.reciprocal()


def cast_rows_reference(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None):
    """(x [N, C] scaled per row, clamped, in ``dtype``, row-major; the reciprocal scales [N, 1])."""
    if amax is None:
        amax = x.abs().float().amax(dim=1, keepdim=True)
    scale, inv = pow2_scales_reference(amax, dtype)
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype), inv


def cast_columns_reference(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None):
    """(x [G, K, M] scaled per (g, m) over K, clamped, in ``dtype``, column-major (its [G, M, K]
    transpose contiguous); the reciprocal scales [G, 1, M])."""
    if amax is None:
        amax = x.abs().float().amax(dim=1, keepdim=True)
    scale, inv = pow2_scales_reference(amax, dtype)
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype).mT.contiguous().mT, inv


# ----------------------------------------------------------------------------- kernels


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """[N, 1] fp32 max |x| of each row of x [N, C] (the caller checks ``available``)."""
    n, cols = x.shape
    amax = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n:
        _rows_kernel[(triton.cdiv(n, ROWS_BLOCK_ROWS),)](
            x, amax, amax, amax, n, cols, x.stride(0), x.stride(1), 1.0, AMAX_FLOOR, GIVEN_AMAX=False,
            AMAX_ONLY=True, BLOCK_ROWS=ROWS_BLOCK_ROWS, BLOCK_COLS=ROWS_BLOCK_COLS)
    return amax


def cast_rows(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None):
    """``cast_rows_reference`` in one Triton kernel (the caller checks ``available``)."""
    n, cols = x.shape
    out = torch.empty(n, cols, dtype=dtype, device=x.device)
    inv = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n:
        _rows_kernel[(triton.cdiv(n, ROWS_BLOCK_ROWS),)](
            x, inv if amax is None else amax, out, inv, n, cols, x.stride(0), x.stride(1), torch.finfo(dtype).max,
            AMAX_FLOOR, GIVEN_AMAX=amax is not None, AMAX_ONLY=False, BLOCK_ROWS=ROWS_BLOCK_ROWS,
            BLOCK_COLS=ROWS_BLOCK_COLS)
    return out, inv


def column_amax(x: torch.Tensor) -> torch.Tensor:
    """[G, 1, M] fp32 max |x| over K of x [G, K, M] (the caller checks ``available``)."""
    groups, k, m = x.shape
    amax = torch.empty(groups, 1, m, dtype=torch.float32, device=x.device)
    if groups and m:
        _columns_kernel[(groups, triton.cdiv(m, COLS_BLOCK_M))](
            x, amax, amax, amax, k, m, x.stride(0), x.stride(1), x.stride(2), 1.0, AMAX_FLOOR, GIVEN_AMAX=False,
            AMAX_ONLY=True, BLOCK_K=COLS_BLOCK_K, BLOCK_M=COLS_BLOCK_M)
    return amax


def cast_columns(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None):
    """``cast_columns_reference`` in one Triton kernel (the caller checks ``available``)."""
    groups, k, m = x.shape
    out = torch.empty(groups, m, k, dtype=dtype, device=x.device)
    inv = torch.empty(groups, 1, m, dtype=torch.float32, device=x.device)
    if groups and m:
        _columns_kernel[(groups, triton.cdiv(m, COLS_BLOCK_M))](
            x, inv if amax is None else amax, out, inv, k, m, x.stride(0), x.stride(1), x.stride(2),
            torch.finfo(dtype).max, AMAX_FLOOR, GIVEN_AMAX=amax is not None, AMAX_ONLY=False, BLOCK_K=COLS_BLOCK_K,
            BLOCK_M=COLS_BLOCK_M)
    return out.mT, inv


if triton is not None:

    @triton.jit
    def _pow2_scale(amax, limit, floor):
        """limit / amax as torch computes it (a reciprocal, then a product), then its mantissa masked
        off: the largest power of two not above it."""
        scale = tl.math.div_rn(1.0, tl.maximum(amax, floor)) * limit
        return (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _rows_kernel(x_ptr, amax_ptr, out_ptr, inv_ptr, n, cols, stride_n, stride_c, limit, floor,
                     GIVEN_AMAX: tl.constexpr, AMAX_ONLY: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     BLOCK_COLS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        rows = r < n
        if GIVEN_AMAX:
            amax = tl.load(amax_ptr + r, mask=rows, other=0.0)
        else:
            acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for c0 in range(0, cols, BLOCK_COLS):
                c = c0 + tl.arange(0, BLOCK_COLS)
                mask = rows[:, None] & (c[None, :] < cols)
                x = tl.load(x_ptr + r[:, None] * stride_n + c[None, :] * stride_c, mask=mask, other=0.0)
                acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
            amax = tl.max(acc, axis=1)
        if AMAX_ONLY:
            tl.store(amax_ptr + r, amax, mask=rows)
        else:
            scale = _pow2_scale(amax, limit, floor)
            tl.store(inv_ptr + r, tl.math.div_rn(1.0, scale), mask=rows)
            for c0 in range(0, cols, BLOCK_COLS):
                c = c0 + tl.arange(0, BLOCK_COLS)
                mask = rows[:, None] & (c[None, :] < cols)
                x = tl.load(x_ptr + r[:, None] * stride_n + c[None, :] * stride_c, mask=mask, other=0.0)
                q = tl.clamp(x.to(tl.float32) * scale[:, None], -limit, limit).to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + r[:, None] * cols + c[None, :], q, mask=mask)

    @triton.jit
    def _columns_kernel(x_ptr, amax_ptr, out_ptr, inv_ptr, k, m, stride_g, stride_k, stride_m, limit, floor,
                        GIVEN_AMAX: tl.constexpr, AMAX_ONLY: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_M: tl.constexpr):
        g = tl.program_id(0).to(tl.int64)
        cm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = cm < m
        x_ptr += g * stride_g
        if GIVEN_AMAX:
            amax = tl.load(amax_ptr + g * m + cm, mask=columns, other=0.0)
        else:
            acc = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                mask = (rk[:, None] < k) & columns[None, :]
                x = tl.load(x_ptr + rk[:, None] * stride_k + cm[None, :] * stride_m, mask=mask, other=0.0)
                acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
            amax = tl.max(acc, axis=0)
        if AMAX_ONLY:
            tl.store(amax_ptr + g * m + cm, amax, mask=columns)
        else:
            scale = _pow2_scale(amax, limit, floor)
            tl.store(inv_ptr + g * m + cm, tl.math.div_rn(1.0, scale), mask=columns)
            out_ptr += g * m * k
            for k0 in range(0, k, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                mask = (rk[:, None] < k) & columns[None, :]
                x = tl.load(x_ptr + rk[:, None] * stride_k + cm[None, :] * stride_m, mask=mask, other=0.0)
                q = tl.clamp(x.to(tl.float32) * scale[None, :], -limit, limit).to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + cm[None, :].to(tl.int64) * k + rk[:, None], q, mask=mask)
