"""Fused interleaved MRoPE: one Triton kernel forward, one backward, beside a PyTorch reference.

The unfused path materialises angles [.., rot_dim] in fp32, then cos, sin, their casts,
rotate_half, two products, a sum and a cat: about ten passes over q and k. The kernel reads
the 3-D position ids and ``inv_freq`` directly, picks each frequency's axis from
``mrope_section`` (constexpr), computes cos/sin in fp32 per token (shared by all heads),
rotates the first ``rot_dim`` channels, copies the rest, and writes the output dtype once.
Backward is the same kernel rotating by the opposite angle (the rotation is orthogonal),
so autograd saves only the position ids.

Layouts (``layout``): "bshd" [B, S, H, D], "sbhd" [S, B, H, D] (megatron hands attention q/k
like this; any strides with a unit channel stride are read in place, no copies), "thd"
[T, H, D]. Position ids are [3, B, S] (or [3, T] for thd).

The vision encoder's 2-D rotary is the blocked (non-interleaved) form with section (0, n, n):
frequencies [0, n) read the patch row, [n, 2n) its column, rotary over the whole head.

Context parallelism: the data pipeline splits position ids with the tokens, so the plain
mode already works per rank. ``cu_seqlens`` + ``cp_size``/``cp_rank`` select the zigzag mode
instead: position ids hold the full packed sequence, ``cu_seqlens`` (device) its padded
sample boundaries, and the kernel maps each local token to its global index (sample i of
length L is cut into 2*cp chunks of L/(2cp); rank r holds chunk r then chunk 2cp-1-r).
Lengths must divide by 2*cp; ``check_zigzag`` verifies that once per batch (one host sync),
never per layer.
"""

from __future__ import annotations

import functools
import logging

import torch

from core.zigzag import zigzag_indices
from fused_kernels.rotary import apply_rotary, axis_of_frequency, mrope_angles

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the reference still works
    triton = None

from fused_kernels.triton_support import autotuning, cu_block, interpreting, unavailable_reason  # noqa: E402

LAYOUTS = ("bshd", "sbhd", "thd")


# ----------------------------------------------------------------------------- reference


def zigzag_global_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token index of each local token of rank cp_rank (host side: reference only); the
    split the model's data path uses (core.zigzag.zigzag_indices)."""
    cu = cu_seqlens.tolist()
    segments = [e - s for s, e in zip(cu[:-1], cu[1:])]
    return zigzag_indices(segments, cp_size, cp_rank).to(cu_seqlens.device)


def mrope_reference(x, position_ids, inv_freq, mrope_section, interleaved=True, layout="bshd",
                    cu_seqlens=None, cp_size=1, cp_rank=0):
    """The model's PyTorch path (mrope_angles + apply_rotary), in any of the kernel's layouts."""
    pos = _positions_3bs(position_ids, layout)
    if cu_seqlens is not None:
        pos = pos[:, :, zigzag_global_index(cu_seqlens, cp_size, cp_rank)]
    axis = axis_of_frequency(inv_freq.numel(), list(mrope_section), interleaved)
    angles = mrope_angles(pos, inv_freq, axis)  # [B, S, rot]
    if layout == "bshd":
        return apply_rotary(x, angles.unsqueeze(2))
    if layout == "sbhd":
        return apply_rotary(x, angles.transpose(0, 1).unsqueeze(2))
    return apply_rotary(x, angles[0].unsqueeze(1))


def _positions_3bs(position_ids: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "thd" and position_ids.dim() == 2:
        return position_ids.unsqueeze(1)
    return position_ids


# ----------------------------------------------------------------------------- checks


def available(x: torch.Tensor, layout: str = "sbhd") -> str | None:
    """None when the fused kernel can run on x, else the reason (for the fallback warning)."""
    reason = unavailable_reason(x)
    if reason is not None:
        return reason
    if layout not in LAYOUTS:
        return f"layout {layout!r} is not one of {LAYOUTS}"
    return None


def check_zigzag(cu_seqlens: torch.Tensor, cp_size: int) -> None:
    """Once per batch (one host sync): every sample length must split into 2*cp_size chunks."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool(((lens % (2 * cp_size)) != 0).any()):
        raise ValueError(f"zigzag CP needs every padded sample length divisible by 2*cp={2 * cp_size}; "
                         f"got lengths {lens.tolist()}")


# ----------------------------------------------------------------------------- kernel

if triton is not None:

    def _configs():
        # several configs cannot be benchmarked without a GPU: one config under the interpreter
        if not autotuning():
            return [triton.Config({"ELEMS": 2048 if interpreting() else 8192}, num_warps=4)]
        # few configs: each one is compiled per shape (first call), and these are memory bound
        return [triton.Config({"ELEMS": 8192}, num_warps=4), triton.Config({"ELEMS": 4096}, num_warps=4)]

    # Token counts, sample counts and the strides that scale with them change from batch to batch
    # (the vision encoder's patch count above all). Triton would specialise on each integer's
    # value being 1 or a multiple of 16 and compile a new variant (and re-run the autotuner) when
    # that changes mid-training, which costs whole seconds each time: not for these.
    @triton.autotune(configs=_configs(), key=["H", "D", "HALF", "ZIGZAG"])
    @triton.jit(do_not_specialize=["n_tok", "S", "n_cu", "cp_size", "cp_rank", "sxb", "sob", "spa", "spb"])
    def _mrope_kernel(
        x_ptr, o_ptr, pos_ptr, inv_ptr, cu_ptr,
        n_tok, S, H, n_cu, cp_size, cp_rank,
        sxb, sxs, sxh, sob, sos, soh, spa, spb, sps,
        D: tl.constexpr, HALF: tl.constexpr, SEC0: tl.constexpr, SEC1: tl.constexpr, SEC2: tl.constexpr,
        INTERLEAVED: tl.constexpr, ZIGZAG: tl.constexpr, BACKWARD: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_CU: tl.constexpr,
        BLOCK_D: tl.constexpr, ELEMS: tl.constexpr,
    ):
        # tokens per program: about ELEMS channels in flight (all powers of two, so this is one too)
        BLOCK_T: tl.constexpr = (ELEMS + BLOCK_H * BLOCK_D - 1) // (BLOCK_H * BLOCK_D)
        tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        tmask = tok < n_tok
        b = tok // S
        s = tok % S
        if ZIGZAG:
            # local token s (B == 1) -> global index; sample i = number of local ends <= s
            j = tl.arange(0, BLOCK_CU)
            cu = tl.load(cu_ptr + j, mask=j < n_cu, other=0).to(tl.int64)
            ends = (cu[None, :] // cp_size <= s[:, None]) & (j[None, :] >= 1) & (j[None, :] < n_cu)
            i = tl.minimum(tl.sum(ends.to(tl.int32), axis=1), n_cu - 2)
            start = tl.load(cu_ptr + i, mask=tmask, other=0).to(tl.int64)
            end = tl.load(cu_ptr + i + 1, mask=tmask, other=0).to(tl.int64)
            chunk = (end - start) // (2 * cp_size)
            off = s - start // cp_size
            g = tl.where(off < chunk, start + cp_rank * chunk + off,
                         start + (2 * cp_size - 1 - cp_rank) * chunk + off - chunk)
            poff = g * sps
        else:
            poff = b * spb + s * sps
        p0 = tl.load(pos_ptr + poff, mask=tmask, other=0).to(tl.float32)
        p1 = tl.load(pos_ptr + spa + poff, mask=tmask, other=0).to(tl.float32)
        p2 = tl.load(pos_ptr + 2 * spa + poff, mask=tmask, other=0).to(tl.float32)

        f = tl.arange(0, BLOCK_F)
        fmask = f < HALF
        if INTERLEAVED:  # frequency 3j+1 reads h (j < SEC1), 3j+2 reads w (j < SEC2), others t
            ax = tl.where((f % 3 == 1) & (f < 3 * SEC1), 1, tl.where((f % 3 == 2) & (f < 3 * SEC2), 2, 0))
        else:
            ax = tl.where(f < SEC0, 0, tl.where(f < SEC0 + SEC1, 1, 2))
        pos = tl.where(ax[None, :] == 1, p1[:, None], tl.where(ax[None, :] == 2, p2[:, None], p0[:, None]))
        inv = tl.load(inv_ptr + f, mask=fmask, other=0.0)
        ang = pos * inv[None, :]  # same fp32 product as the reference
        cos = tl.cos(ang)[:, None, :]
        sin = tl.sin(ang)[:, None, :]
        if BACKWARD:  # the transpose of a rotation is the rotation by -angle
            sin = -sin

        h = tl.arange(0, BLOCK_H)
        mrow = tmask[:, None, None] & (h < H)[None, :, None]
        xrow = (b * sxb + s * sxs)[:, None, None] + h[None, :, None] * sxh
        orow = (b * sob + s * sos)[:, None, None] + h[None, :, None] * soh
        m = mrow & fmask[None, None, :]
        x1 = tl.load(x_ptr + xrow + f[None, None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xrow + HALF + f[None, None, :], mask=m, other=0.0).to(tl.float32)
        out_ty = o_ptr.dtype.element_ty
        tl.store(o_ptr + orow + f[None, None, :], (x1 * cos - x2 * sin).to(out_ty), mask=m)
        tl.store(o_ptr + orow + HALF + f[None, None, :], (x2 * cos + x1 * sin).to(out_ty), mask=m)
        # channels past the rotary dim pass through
        for c0 in tl.static_range(2 * HALF, D, BLOCK_P):
            c = c0 + tl.arange(0, BLOCK_P)
            mp = mrow & (c < D)[None, None, :]
            v = tl.load(x_ptr + xrow + c[None, None, :], mask=mp)
            tl.store(o_ptr + orow + c[None, None, :], v.to(out_ty), mask=mp)


def _launch(x, out, position_ids, inv_freq, mrope_section, interleaved, layout, cu_seqlens, cp_size, cp_rank,
            backward):
    if layout == "thd":
        x4, o4 = x.unsqueeze(0), out.unsqueeze(0)  # [1, T, H, D]
    elif layout == "sbhd":
        x4, o4 = x.transpose(0, 1), out.transpose(0, 1)  # strided [B, S, H, D] views, no copy
    else:
        x4, o4 = x, out
    B, S, H, D = x4.shape
    half = inv_freq.numel()
    pos = _positions_3bs(position_ids, layout)
    zig = cu_seqlens is not None
    if zig and B != 1:
        raise ValueError("zigzag CP mode needs one packed row (B == 1)")
    if zig and pos.shape[-1] != S * cp_size:
        raise ValueError(f"zigzag CP mode: position ids cover {pos.shape[-1]} tokens, expected {S}*cp={S * cp_size}")
    if not zig and tuple(pos.shape[1:]) != (B, S):
        raise ValueError(f"position ids {tuple(pos.shape)} do not match q/k tokens [3, {B}, {S}]")
    n_tok = B * S
    if n_tok == 0:
        return out
    block_h = triton.next_power_of_2(H)
    block_f = triton.next_power_of_2(half)
    block_p = min(64, triton.next_power_of_2(max(D - 2 * half, 1)))
    n_cu = cu_seqlens.numel() if zig else 2
    sec = list(mrope_section) + [0] * (3 - len(mrope_section))

    block_d = triton.next_power_of_2(D)

    def grid(meta):
        return (triton.cdiv(n_tok, triton.cdiv(meta["ELEMS"], block_h * block_d)),)

    _mrope_kernel[grid](
        x4, o4, pos, inv_freq, cu_seqlens if zig else pos,
        n_tok, S, H, n_cu, cp_size, cp_rank,
        x4.stride(0), x4.stride(1), x4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2),
        pos.stride(0), pos.stride(1), pos.stride(2),
        D=D, HALF=half, SEC0=sec[0], SEC1=sec[1], SEC2=sec[2], INTERLEAVED=bool(interleaved), ZIGZAG=zig,
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_F=block_f, BLOCK_P=block_p,
        BLOCK_CU=cu_block(n_cu), BLOCK_D=block_d,
    )
    return out



def _unit_channel_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rotated(x, position_ids, inv_freq, mrope_section, interleaved, layout, backward, cu_seqlens=None, cp_size=1,
             cp_rank=0) -> torch.Tensor:
    """x rotated (``backward``: rotated back) into a new tensor with x's strides (sbhd stays sbhd)."""
    x = _unit_channel_stride(x)
    return _launch(x, torch.empty_like(x), position_ids, inv_freq, mrope_section, interleaved, layout, cu_seqlens,
                   cp_size, cp_rank, backward)


class _FusedMRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, position_ids, inv_freq, mrope_section, interleaved, layout, cu_seqlens, cp_size, cp_rank):
        ctx.save_for_backward(position_ids, inv_freq, cu_seqlens)
        ctx.args = (mrope_section, interleaved, layout, cp_size, cp_rank)
        return _rotated(x, position_ids, inv_freq, mrope_section, interleaved, layout, False, cu_seqlens, cp_size,
                        cp_rank)

    @staticmethod
    def backward(ctx, grad):
        position_ids, inv_freq, cu_seqlens = ctx.saved_tensors
        mrope_section, interleaved, layout, cp_size, cp_rank = ctx.args
        dx = _rotated(grad, position_ids, inv_freq, mrope_section, interleaved, layout, True, cu_seqlens, cp_size,
                      cp_rank)
        return dx, None, None, None, None, None, None, None, None


def fused_mrope(x, position_ids, inv_freq, mrope_section, interleaved=True, layout="bshd",
                cu_seqlens=None, cp_size=1, cp_rank=0) -> torch.Tensor:
    """Rotate the first 2*len(inv_freq) channels of every head of x by its token's MRoPE angles.

    x: see the module docstring for layouts; position_ids int [3, B, S] ([3, T] for thd, or
    the full sequence in zigzag mode); inv_freq fp32 [rot_dim/2] on x's device.
    """
    if cu_seqlens is None and cp_size != 1:
        raise ValueError("cp_size > 1 needs cu_seqlens (zigzag mode); with per-rank position ids pass cp_size=1")
    inv_freq = _inv_freq_f32(inv_freq)
    return _FusedMRope.apply(x, position_ids, inv_freq, tuple(int(s) for s in mrope_section), interleaved, layout,
                             cu_seqlens, cp_size, cp_rank)


class _FusedMRopePair(torch.autograd.Function):
    """``fused_mrope`` of two tensors (attention's q and k) by the same angles, in one autograd node.

    One launch per tensor each way and nothing else. Concatenating q and k for a single launch
    instead costs a copy of both in the forward and, in the backward, a zero-filled gradient of
    the concatenation per output plus their sum (five kernels over q|k per layer)."""

    @staticmethod
    def forward(ctx, query, key, position_ids, inv_freq, mrope_section, interleaved, layout):
        ctx.save_for_backward(position_ids, inv_freq)
        ctx.args = (mrope_section, interleaved, layout)
        ctx.set_materialize_grads(False)
        return tuple(_rotated(x, position_ids, inv_freq, mrope_section, interleaved, layout, False)
                     for x in (query, key))

    @staticmethod
    def backward(ctx, d_query, d_key):
        position_ids, inv_freq = ctx.saved_tensors
        mrope_section, interleaved, layout = ctx.args
        grads = [None if g is None else _rotated(g, position_ids, inv_freq, mrope_section, interleaved, layout, True)
                 for g in (d_query, d_key)]
        return (*grads, None, None, None, None, None)


def fused_mrope_pair(query, key, position_ids, inv_freq, mrope_section, interleaved=True, layout="bshd"):
    """``(fused_mrope(query, ...), fused_mrope(key, ...))`` as one autograd node, two launches each
    way; position ids per token of these tensors (the plain mode: no zigzag arguments)."""
    return _FusedMRopePair.apply(query, key, position_ids, _inv_freq_f32(inv_freq),
                                 tuple(int(s) for s in mrope_section), interleaved, layout)


class _RotaryQKV(torch.autograd.Function):
    """q and k rotated, and v, from one [T, 3, H, D] projection (the vision blocks' qkv).

    Forward: one launch rotates q and k (read in place from the projection) into a [T, 2H, D]
    tensor; q and k are its halves, v is the projection's third slot. Backward: the rotation back
    writes dq and dk straight into their slots of one [T, 3, H, D] gradient and dv is copied into
    the third. Split with unbind and slices instead, autograd materialises a zero-filled
    projection-sized gradient for each piece and sums them: about nine small kernels per block
    where this takes three."""

    @staticmethod
    def forward(ctx, qkv, position_ids, inv_freq, mrope_section, interleaved):
        t, _, h, d = qkv.shape
        qk = torch.empty(t, 2 * h, d, dtype=qkv.dtype, device=qkv.device)
        _launch(qkv[:, :2].reshape(t, 2 * h, d), qk, position_ids, inv_freq, mrope_section, interleaved, "thd",
                None, 1, 0, False)
        ctx.save_for_backward(position_ids, inv_freq)
        ctx.args = (mrope_section, interleaved)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: zero its slot here
        return qk[:, :h], qk[:, h:], qkv[:, 2]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        position_ids, inv_freq = ctx.saved_tensors
        mrope_section, interleaved = ctx.args
        like = next(g for g in (dq, dk, dv) if g is not None)
        t, h, d = like.shape
        grad = torch.empty(t, 3, h, d, dtype=like.dtype, device=like.device)
        for slot, g in enumerate((dq, dk)):
            if g is None:
                grad[:, slot].zero_()
            else:
                _launch(_unit_channel_stride(g), grad[:, slot], position_ids, inv_freq, mrope_section, interleaved,
                        "thd", None, 1, 0, True)
        if dv is None:
            grad[:, 2].zero_()
        else:
            grad[:, 2].copy_(dv)
        return grad, None, None, None, None


def rotary_qkv(qkv, position_ids, inv_freq, mrope_section, interleaved=False):
    """(q, k, v) from a [T, 3, H, D] projection, q and k rotated by ``fused_mrope``'s angles (thd
    layout, position ids [3, T]); gradients flow back into one [T, 3, H, D] tensor."""
    if qkv.dim() != 4 or qkv.shape[1] != 3 or qkv.stride(-1) != 1:
        raise ValueError(f"rotary_qkv needs a [T, 3, H, D] projection with unit channel stride, got "
                         f"{tuple(qkv.shape)} strides {qkv.stride()}")
    return _RotaryQKV.apply(qkv, position_ids, _inv_freq_f32(inv_freq), tuple(int(s) for s in mrope_section),
                            interleaved)


def rotary_qkv_reference(qkv, position_ids, inv_freq, mrope_section, interleaved=False):
    """``rotary_qkv`` in plain PyTorch: unbind, then the reference rotation of q and k."""
    q, k, v = qkv.unbind(1)
    return (mrope_reference(q, position_ids, inv_freq, mrope_section, interleaved, "thd"),
            mrope_reference(k, position_ids, inv_freq, mrope_section, interleaved, "thd"), v)


def _inv_freq_f32(inv_freq: torch.Tensor) -> torch.Tensor:
    return inv_freq if inv_freq.dtype == torch.float32 and inv_freq.is_contiguous() else inv_freq.float().contiguous()


@functools.cache
def warn_fallback(reason: str) -> None:
    """One warning per distinct reason when the model asked for the fused path but cannot use it."""
    logging.getLogger(__name__).warning("fused MRoPE requested but not used: %s; using the PyTorch path", reason)
