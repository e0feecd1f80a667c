"""SwiGLU, ``silu(y[..., :F]) * y[..., F:]``, as one Triton kernel per direction.

Why not megatron-core's own fused function (torch.compile'd ``swiglu`` / ``swiglu_back``): its
backward is ``cat((g * dsilu(a) * b, g * silu(a)), -1)``, which Inductor lowers to one kernel over
the *output* [N, 2F] that, for every element, loads both halves of y and g again: each input
byte is read twice (near copy bandwidth, but twice the bytes needed). Here each program owns a
block of (row, column) pairs of the [N, F] half and writes both gradient halves from one read
of a, b and g: 5 x N x F elements moved in the backward, the minimum, and 3 x N x F in the
forward.

Both kernels compute in fp32 and round once on store, like Inductor's bf16 lowering of the same
expressions. ``swiglu_reference`` / ``swiglu_back_reference`` are the plain PyTorch definitions
the tests check the kernels against.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the references still work
    triton = None

from fused_kernels.triton_support import unavailable_reason  # noqa: E402

log = logging.getLogger(__name__)

BLOCK = 1024  # elements of the [N, F] half per program (8 per thread at 4 warps: 16-byte bf16 loads)


def _up(t: torch.Tensor) -> torch.Tensor:
    """At least fp32, as the kernels compute (fp64 stays fp64 for exact checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    a, b = (_up(t) for t in torch.chunk(y, 2, dim=-1))
    return (F.silu(a) * b).to(y.dtype)


def swiglu_back_reference(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a, b = (_up(t) for t in torch.chunk(y, 2, dim=-1))
    sig = torch.sigmoid(a)
    g = _up(g)
    da = g * b * sig * (1.0 + a * (1.0 - sig))
    return torch.cat((da, g * a * sig), dim=-1).to(y.dtype)


def available(y: torch.Tensor) -> str | None:
    """None when the kernels can run on ``y`` (fc1's output), else the reason."""
    reason = unavailable_reason(y)
    if reason is not None:
        return reason
    if y.shape[-1] % 2:
        return f"last dimension {y.shape[-1]} is odd (SwiGLU splits it in two halves)"
    return None


if triton is not None:

    @triton.jit
    def _swiglu_fwd(y_ptr, out_ptr, n, F_HALF: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        row, col = i // F_HALF, i % F_HALF
        a_ptr = y_ptr + row * (2 * F_HALF) + col
        a = tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(a_ptr + F_HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, (a * tl.sigmoid(a) * b).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(g_ptr, y_ptr, dy_ptr, n, F_HALF: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        row, col = i // F_HALF, i % F_HALF
        off = row * (2 * F_HALF) + col
        a = tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(y_ptr + off + F_HALF, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        da = g * b * sig * (1.0 + a * (1.0 - sig))
        db = g * a * sig
        tl.store(dy_ptr + off, da.to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dy_ptr + off + F_HALF, db.to(dy_ptr.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


class SwiGLUFunction(torch.autograd.Function):
    """Keeps only fc1's output for backward, like megatron's."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        f = y.shape[-1] // 2
        out = y.new_empty(*y.shape[:-1], f)
        n = out.numel()
        if n:
            _swiglu_fwd[_grid(n)](y, out, n, F_HALF=f, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        g = g.contiguous()
        dy = torch.empty_like(y)
        n = g.numel()
        if n:
            _swiglu_bwd[_grid(n)](g, y, dy, n, F_HALF=y.shape[-1] // 2, BLOCK=BLOCK, num_warps=4)
        return dy


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """The Triton kernels; callers check ``available(y)`` first."""
    return SwiGLUFunction.apply(y)


# ------------------------------------------------------------ weighted SwiGLU (MoE experts)
# The routed experts scale each token's SwiGLU output by its router probability before fc2:
# out = silu(a) * b * p, with p one fp32 value per row. Its backward needs the probability's
# gradient too, a sum over the row, so these kernels own whole rows: one program per row reads
# a, b (and g) once and writes out (or da, db and dp).


def weighted_swiglu_reference(y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b * p`` computed in fp32, rounded once to y's dtype; ``p`` is [N] or [N, 1]."""
    a, b = (_up(t) for t in torch.chunk(y, 2, dim=-1))
    return (F.silu(a) * b * _up(p).reshape(-1, 1)).to(y.dtype)


def weighted_swiglu_back_reference(g: torch.Tensor, y: torch.Tensor, p: torch.Tensor):
    """(dy, dp) of ``weighted_swiglu_reference``; dp has p's shape and dtype."""
    a, b = (_up(t) for t in torch.chunk(y, 2, dim=-1))
    g, w = _up(g), _up(p).reshape(-1, 1)
    sig = torch.sigmoid(a)
    gw = g * w
    dy = torch.cat((gw * b * sig * (1.0 + a * (1.0 - sig)), gw * a * sig), dim=-1).to(y.dtype)
    dp = (g * a * sig * b).sum(-1).reshape(p.shape).to(p.dtype)
    return dy, dp


if triton is not None:

    @triton.jit
    def _wswiglu_fwd(y_ptr, p_ptr, out_ptr, F_HALF: tl.constexpr, BLOCK_F: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p = tl.load(p_ptr + row).to(tl.float32)
        for start in range(0, F_HALF, BLOCK_F):
            col = start + tl.arange(0, BLOCK_F)
            mask = col < F_HALF
            a = tl.load(y_ptr + row * (2 * F_HALF) + col, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(y_ptr + row * (2 * F_HALF) + F_HALF + col, mask=mask, other=0.0).to(tl.float32)
            out = a * tl.sigmoid(a) * b * p
            tl.store(out_ptr + row * F_HALF + col, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _wswiglu_bwd(g_ptr, y_ptr, p_ptr, dy_ptr, dp_ptr, F_HALF: tl.constexpr, BLOCK_F: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p = tl.load(p_ptr + row).to(tl.float32)
        acc = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for start in range(0, F_HALF, BLOCK_F):
            col = start + tl.arange(0, BLOCK_F)
            mask = col < F_HALF
            off = row * (2 * F_HALF) + col
            a = tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(y_ptr + off + F_HALF, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * F_HALF + col, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(a)
            gw = g * p
            tl.store(dy_ptr + off, (gw * b * sig * (1.0 + a * (1.0 - sig))).to(dy_ptr.dtype.element_ty), mask=mask)
            tl.store(dy_ptr + off + F_HALF, (gw * a * sig).to(dy_ptr.dtype.element_ty), mask=mask)
            acc += g * a * sig * b
        tl.store(dp_ptr + row, tl.sum(acc, axis=0).to(dp_ptr.dtype.element_ty))


def _block_f(f: int) -> int:
    return min(1024, triton.next_power_of_2(f))


def weighted_swiglu_forward(y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (no autograd): y [N, 2F] contiguous, p [N] contiguous."""
    f = y.shape[-1] // 2
    out = y.new_empty(y.shape[0], f)
    if y.shape[0]:
        _wswiglu_fwd[(y.shape[0],)](y, p, out, F_HALF=f, BLOCK_F=_block_f(f), num_warps=4)
    return out


def weighted_swiglu_backward(g: torch.Tensor, y: torch.Tensor, p: torch.Tensor):
    """(dy, dp) by the Triton kernel (no autograd); g [N, F], y [N, 2F], p [N], all contiguous."""
    dy = torch.empty_like(y)
    dp = torch.empty_like(p)
    if y.shape[0]:
        f = y.shape[-1] // 2
        _wswiglu_bwd[(y.shape[0],)](g, y, p, dy, dp, F_HALF=f, BLOCK_F=_block_f(f), num_warps=4)
    return dy, dp
