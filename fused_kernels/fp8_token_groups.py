"""The FP8 operands of the routed experts' weight gradient, quantized per expert group in two Triton
kernels, with their plain PyTorch references.

The weight-gradient GEMM of the experts contracts over each expert's tokens: ``dW[e] = A[e]^T B[e]``
with A [N, M] and B [N, K] the rows (tokens) grouped by expert through ``offs``. Rowwise FP8 scales
each operand per (expert, column) over that expert's rows, and torch's grouped FP8 GEMM takes both
operands with the tokens contiguous ([M, width] and [K, width]) and every group starting on a
multiple of 16 tokens. Written with torch ops that is a scatter-reduce for the amax (atomics over
every element), a gathered [N, C] scale tensor, a cast, an fp8 transpose and an index copy into the
padded layout: five passes, the first the largest single cost of an FP8 MoE step (docs/fp8.md). Here:

- ``group_amax``: [G, C] fp32 max |x| over each group's rows;
- the caller turns it into scales (``models/common/fp8_gemm.py``, the same function as every cast);
- ``cast_groups_transposed``: casts each row with its group's scales and stores it transposed, at
  the padded position ``row + new_offs[g] - offs[g]``.

A dense linear's weight gradient is the case of one group holding every row: ``column_amax`` and
``cast_transposed`` run the same kernels with the group's bounds taken from the row count instead
of device tensors (no offsets, chunk plan or zero fill to build first: a handful of small launches
per operand that a dense step, already waiting on the host, cannot afford), the padding after the
rows.

Each program takes one chunk of one group's rows (``chunk_plan``) and one block of columns: its
bounds are scalars, so it reads and writes contiguous memory, and a group holding most of the rows
(a popular expert) is spread over many programs; the chunks of one group meet in the amax through
an atomic max. Rows past the last offset belong to no group and are not written (the padded
output is zeros there, which the GEMM does not read).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the references still work
    triton = None

from fused_kernels.triton_support import unavailable_reason  # noqa: E402

BLOCK_ROWS = 64
CHUNK_ROWS = 512  # rows per program: a multiple of BLOCK_ROWS
BLOCK_COLS = 64
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ALIGN = 16  # torch's grouped FP8 GEMM: every group starts on a 16-byte (16 fp8 tokens) boundary


def available(x: torch.Tensor) -> str | None:
    """None when the kernels can quantize ``x`` [N, C], else the reason."""
    reason = unavailable_reason(x)
    if reason is None and x.dim() != 2:
        reason = f"x has {x.dim()} dimensions, not 2"
    return reason


def padded_offsets(offs: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Each group's end once every group is rounded up to a multiple of 16 rows (on the device, no
    host sync), and the padded width's host bound, round_up(n, 16) + 16 x G."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    new_offs = torch.cumsum((sizes + ALIGN - 1) // ALIGN * ALIGN, 0).to(offs.dtype)
    return new_offs, -(-n // ALIGN) * ALIGN + ALIGN * offs.numel()


def group_of_rows(offs: torch.Tensor, n: int) -> torch.Tensor:
    """The group of each of ``n`` rows (int64, on the device; rows past the last offset get G)."""
    return torch.searchsorted(offs, torch.arange(n, device=offs.device, dtype=offs.dtype), right=True)


# ----------------------------------------------------------------------------- references


def group_amax_reference(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, C] fp32 max |x| over each group's rows of x [N, C] (an empty group: 0)."""
    groups = offs.numel()
    rows = group_of_rows(offs, x.shape[0])
    out = torch.zeros(groups + 1, x.shape[1], dtype=torch.float32, device=x.device)
    out.scatter_reduce_(0, rows[:, None].expand(-1, x.shape[1]), x.abs().float(), "amax")
    return out[:groups]


def cast_groups_transposed_reference(x: torch.Tensor, offs: torch.Tensor, new_offs: torch.Tensor, width: int,
                                     scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[C, width] in ``dtype``: row n of x [N, C] times its group's scale [G, C], clamped to the fp8
    range and cast, at column ``n + new_offs[g] - offs[g]``; zeros elsewhere (and for rows in no group)."""
    n, groups = x.shape[0], offs.numel()
    as_int = SAME_SIZE_INT[dtype.itemsize]  # through a same-size integer view: index_copy_ has no fp8 kernels
    out = torch.zeros(x.shape[1], width, dtype=as_int, device=x.device)
    if groups == 0:
        return out.view(dtype)
    rows = group_of_rows(offs, n)
    grouped = rows < groups
    limit = torch.finfo(dtype).max
    q = (x.float() * scale[rows.clamp(max=groups - 1)]).clamp(-limit, limit).to(dtype)
    dest = torch.arange(n, device=x.device) + (new_offs - offs).to(torch.int64)[rows.clamp(max=groups - 1)]
    out.index_copy_(1, dest[grouped], q[grouped].t().contiguous().view(as_int))
    return out.view(dtype)


def column_amax_reference(x: torch.Tensor) -> torch.Tensor:
    """[1, C] fp32 max |x| over every row of x [N, C] (no rows: 0)."""
    out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
    return torch.maximum(out, x.abs().float().amax(0, keepdim=True)) if x.shape[0] else out


def cast_transposed_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[C, round_up(N, 16)] in ``dtype``: x [N, C] times ``scale`` [1, C], clamped and cast,
    transposed, zeros in the padding columns after the N rows."""
    n, cols = x.shape
    limit = torch.finfo(dtype).max
    out = torch.zeros(cols, -(-n // ALIGN) * ALIGN, dtype=dtype, device=x.device)
    out[:, :n] = (x.float() * scale).clamp(-limit, limit).to(dtype).t()
    return out


# ----------------------------------------------------------------------------- kernels


def chunk_plan(offs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernels' work split: each group's rows in chunks of ``CHUNK_ROWS``, one program per
    (chunk, column block), so a group holding most of the rows (a popular expert) is spread over
    many programs instead of setting the time alone. Returns each program's group ([bound] int32,
    G past the last chunk: those programs do nothing), each group's first chunk ([G] int32) and
    the host bound of the chunk count, cdiv(n, CHUNK_ROWS) + G (no host sync)."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    chunks = (sizes + CHUNK_ROWS - 1) // CHUNK_ROWS
    chunk_end = torch.cumsum(chunks, 0).to(torch.int32)
    bound = -(-n // CHUNK_ROWS) + offs.numel()
    chunk_group = torch.searchsorted(chunk_end, torch.arange(bound, device=offs.device, dtype=torch.int32),
                                     right=True).to(torch.int32)
    return chunk_group, (chunk_end - chunks).to(torch.int32), bound


def group_amax(x: torch.Tensor, offs: torch.Tensor, plan=None) -> torch.Tensor:
    """``group_amax_reference`` in one Triton kernel (the caller checks ``available``); ``plan``:
    ``chunk_plan(offs, len(x))``, shared by the calls on one set of offsets."""
    groups, cols = offs.numel(), x.shape[1]
    out = torch.zeros(groups, cols, dtype=torch.float32, device=x.device)
    if groups and cols:
        chunk_group, chunk_first, bound = plan or chunk_plan(offs, x.shape[0])
        _group_amax_kernel[(bound, triton.cdiv(cols, BLOCK_COLS))](
            x, offs, chunk_group, chunk_first, out, groups, cols, x.shape[0], x.stride(0), x.stride(1),
            CHUNK_ROWS=CHUNK_ROWS, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, ONE_GROUP=False)
    return out


def column_amax(x: torch.Tensor) -> torch.Tensor:
    """``column_amax_reference`` in one Triton kernel (the caller checks ``available``)."""
    n, cols = x.shape
    out = torch.zeros(1, cols, dtype=torch.float32, device=x.device)
    if n and cols:  # the offsets and chunk plan arguments are unused with ONE_GROUP
        _group_amax_kernel[(triton.cdiv(n, CHUNK_ROWS), triton.cdiv(cols, BLOCK_COLS))](
            x, out, out, out, out, 1, cols, n, x.stride(0), x.stride(1),
            CHUNK_ROWS=CHUNK_ROWS, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, ONE_GROUP=True)
    return out


def cast_groups_transposed(x: torch.Tensor, offs: torch.Tensor, new_offs: torch.Tensor, width: int,
                           scale: torch.Tensor, dtype: torch.dtype, plan=None) -> torch.Tensor:
    """``cast_groups_transposed_reference`` in one Triton kernel (the caller checks ``available``)."""
    groups, cols = offs.numel(), x.shape[1]
    out = torch.zeros(cols, width, dtype=dtype, device=x.device)
    if groups and cols:
        chunk_group, chunk_first, bound = plan or chunk_plan(offs, x.shape[0])
        _cast_transposed_kernel[(bound, triton.cdiv(cols, BLOCK_COLS))](
            x, offs, chunk_group, chunk_first, new_offs, scale.contiguous(), out, groups, cols, x.shape[0], width,
            x.stride(0), x.stride(1), torch.finfo(dtype).max,
            CHUNK_ROWS=CHUNK_ROWS, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, ONE_GROUP=False)
    return out


def cast_transposed(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cast_transposed_reference`` in one Triton kernel (the caller checks ``available``); ``scale``
    [1, C], or 0-dim (tensorwise: broadcast, not copied)."""
    n, cols = x.shape
    width = -(-n // ALIGN) * ALIGN
    out = torch.empty(cols, width, dtype=dtype, device=x.device)
    if width > n:  # only the padding needs zeros: a strided fill of at most 15 columns
        out[:, n:].zero_()
    if n and cols:
        scale = scale.reshape(-1)
        _cast_transposed_kernel[(triton.cdiv(n, CHUNK_ROWS), triton.cdiv(cols, BLOCK_COLS))](
            x, out, out, out, out, scale, out, 1, cols, n, width, x.stride(0), x.stride(1), torch.finfo(dtype).max,
            CHUNK_ROWS=CHUNK_ROWS, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, ONE_GROUP=True,
            SCALAR_SCALE=scale.numel() == 1)
    return out


if triton is not None:

    @triton.jit
    def _chunk_rows(offs_ptr, chunk_group_ptr, chunk_first_ptr, groups, n, CHUNK_ROWS: tl.constexpr,
                    ONE_GROUP: tl.constexpr):
        """This program's group, its rows [start, end) (empty past the last chunk) and the group's end;
        with ONE_GROUP, group 0 holds the n rows and the metadata pointers are not read."""
        t = tl.program_id(0)
        if ONE_GROUP:
            g = t * 0
            valid = t >= 0
            group_end = (t * 0 + n).to(tl.int64)  # n may arrive as a constexpr (1)
            start = t.to(tl.int64) * CHUNK_ROWS
        else:
            g = tl.load(chunk_group_ptr + t)
            valid = g < groups
            g = tl.minimum(g, groups - 1)
            group_end = tl.load(offs_ptr + g).to(tl.int64)
            group_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
            start = group_start + (t - tl.load(chunk_first_ptr + g)).to(tl.int64) * CHUNK_ROWS
        end = tl.where(valid, tl.minimum(group_end, start + CHUNK_ROWS), start)
        return g, start, end, group_end, valid

    @triton.jit
    def _group_amax_kernel(x_ptr, offs_ptr, chunk_group_ptr, chunk_first_ptr, out_ptr, groups, cols, n, stride_n,
                           stride_c, CHUNK_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                           ONE_GROUP: tl.constexpr):
        g, start, end, _, valid = _chunk_rows(offs_ptr, chunk_group_ptr, chunk_first_ptr, groups, n, CHUNK_ROWS,
                                              ONE_GROUP)
        c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_ROWS):
            r = r0 + tl.arange(0, BLOCK_ROWS)
            mask = (r[:, None] < end) & (c[None, :] < cols)
            x = tl.load(x_ptr + r[:, None] * stride_n + c[None, :] * stride_c, mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        # the group's chunks meet here: a max of non-negative values, the same whatever the order
        tl.atomic_max(out_ptr + g * cols + c, tl.max(acc, axis=0), mask=(c < cols) & valid)

    @triton.jit
    def _cast_transposed_kernel(x_ptr, offs_ptr, chunk_group_ptr, chunk_first_ptr, new_offs_ptr, scale_ptr, out_ptr,
                                groups, cols, n, width, stride_n, stride_c, limit, CHUNK_ROWS: tl.constexpr,
                                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ONE_GROUP: tl.constexpr,
                                SCALAR_SCALE: tl.constexpr = False):
        g, start, end, group_end, _ = _chunk_rows(offs_ptr, chunk_group_ptr, chunk_first_ptr, groups, n, CHUNK_ROWS,
                                                  ONE_GROUP)
        c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        if ONE_GROUP:  # the rows first, the padding after them
            shift = start * 0
        else:  # the group's padding goes before its rows
            shift = tl.load(new_offs_ptr + g).to(tl.int64) - group_end
        if SCALAR_SCALE:
            scale = tl.load(scale_ptr + c * 0)
        else:
            scale = tl.load(scale_ptr + g * cols + c, mask=c < cols, other=0.0)
        for r0 in range(start, end, BLOCK_ROWS):
            r = r0 + tl.arange(0, BLOCK_ROWS)
            mask = (r[:, None] < end) & (c[None, :] < cols)
            x = tl.load(x_ptr + r[:, None] * stride_n + c[None, :] * stride_c, mask=mask, other=0.0)
            q = tl.clamp(x.to(tl.float32) * scale[None, :], -limit, limit).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + c[None, :].to(tl.int64) * width + (r + shift)[:, None], q, mask=mask)
