"""FP8's tensorwise scaling (one scale for a whole tensor) in two Triton kernels, with their plain
PyTorch references.

Every linear of an FP8 tensorwise step casts its input, its weight and its output gradient with
one scale each: the tensor's amax, then ``fp8_max / amax``, then the clamped cast. Compiled by
inductor that is a split reduction and a pointwise kernel behind dynamo's guards on every call;
in a 9B step the amax alone ran at a third to a quarter of the memory bandwidth, and the calls'
host time left the GPU waiting (docs/fp8.md). Here, for x [N, C] with any strides:

- ``tensor_amax``: fp32 max |x|, each program a chunk of rows and a block of columns, the
  programs meeting through an atomic max (a max of non-negative values: the same in any order);
- ``cast``: reads the amax, computes the scale and its reciprocal itself (the same fp32
  operations, in the same order, as the reference), casts x row-major, and writes the scale and
  its reciprocal into two 0-dim tensors, so neither costs a launch of its own.

Between the two the caller may all-reduce the amax over a tensor-parallel group: the kernels take
it from memory.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the references still work
    triton = None

from fused_kernels.triton_support import unavailable_reason  # noqa: E402

AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale (its quantized values stay zero)
CHUNK_ROWS = 512  # the amax: rows per program, so a few thousand programs meet in the atomic
BLOCK_ROWS = 32
BLOCK_COLS = 128


def available(x: torch.Tensor) -> str | None:
    """None when the kernels can quantize ``x`` [N, C], else the reason."""
    reason = unavailable_reason(x)
    if reason is None and x.dim() != 2:
        reason = f"x has {x.dim()} dimensions, not 2"
    return reason


# ----------------------------------------------------------------------------- references


def tensor_amax_reference(x: torch.Tensor) -> torch.Tensor:
    """0-dim fp32 max |x| (no elements: 0)."""
    return x.abs().amax().float() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def scales_reference(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The multiplier mapping amax onto the fp8 type's largest finite value, and its reciprocal."""
    scale = torch.finfo(dtype).max / amax.clamp(min=AMAX_FLOOR)
    return scale, scale.reciprocal()


def cast_reference(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    """(x times its scale, clamped to the fp8 range, in ``dtype`` [N, C] row-major; scale; 1 / scale)."""
    scale, inv = scales_reference(amax, dtype)
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype), scale, inv


# ----------------------------------------------------------------------------- kernels


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``tensor_amax_reference`` in one Triton kernel (the caller checks ``available``)."""
    n, cols = x.shape
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    if n and cols:
        _amax_kernel[(triton.cdiv(n, CHUNK_ROWS), triton.cdiv(cols, BLOCK_COLS))](
            x, out, n, cols, x.stride(0), x.stride(1), CHUNK_ROWS=CHUNK_ROWS, BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLS=BLOCK_COLS)
    return out


def cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    """``cast_reference`` in one Triton kernel (the caller checks ``available``); ``amax`` 0-dim fp32."""
    n, cols = x.shape
    out = torch.empty(n, cols, dtype=dtype, device=x.device)
    # two allocations, not views of one buffer: on an H100 torch._scaled_mm failed with
    # CUBLAS_STATUS_NOT_SUPPORTED when the inverse scale was the second float of a [2] tensor (a
    # scale pointer off cuBLASLt's alignment); each allocation starts aligned
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    inv = torch.empty((), dtype=torch.float32, device=x.device)
    _cast_kernel[(max(1, triton.cdiv(n, BLOCK_ROWS)), max(1, triton.cdiv(cols, BLOCK_COLS)))](
        x, amax, out, scale, inv, n, cols, x.stride(0), x.stride(1), torch.finfo(dtype).max, AMAX_FLOOR,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
    return out, scale, inv


if triton is not None:

    @triton.jit
    def _amax_kernel(x_ptr, out_ptr, n, cols, stride_n, stride_c, CHUNK_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     BLOCK_COLS: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * CHUNK_ROWS
        c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for r0 in range(0, CHUNK_ROWS, BLOCK_ROWS):
            r = start + r0 + tl.arange(0, BLOCK_ROWS)
            mask = (r[:, None] < n) & (c[None, :] < cols)
            x = tl.load(x_ptr + r[:, None] * stride_n + c[None, :] * stride_c, mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        tl.atomic_max(out_ptr, tl.max(tl.max(acc, axis=1), axis=0))

    @triton.jit
    def _cast_kernel(x_ptr, amax_ptr, out_ptr, scale_ptr, inv_ptr, n, cols, stride_n, stride_c, limit, floor,
                     BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        # torch's `fp8_max / amax` is `amax.reciprocal() * fp8_max`: two roundings, kept here
        amax = tl.maximum(tl.load(amax_ptr), floor)
        scale = tl.math.div_rn(1.0, amax) * limit
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_ptr, scale)
            tl.store(inv_ptr, tl.math.div_rn(1.0, scale))
        r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = (r[:, None] < n) & (c[None, :] < cols)
        x = tl.load(x_ptr + r[:, None] * stride_n + c[None, :] * stride_c, mask=mask, other=0.0)
        q = tl.clamp(x.to(tl.float32) * scale, -limit, limit).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None] * cols + c[None, :], q, mask=mask)
