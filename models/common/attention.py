"""One small attention backend for the decoder and the vision encoder.

Layouts: packed (THD) ``q [T, Hq, D]`` with ``cu_seqlens`` (int32, device) and
``max_seqlen`` (a host int computed by the collate, so no sync here), or batched
``q [B, S, Hq, D]``. k/v may have fewer heads (GQA). Output has q's layout.

Backends:
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``. Packed batches use a
  block-diagonal (causal) mask built on the device from ``cu_seqlens``; memory is
  O(T^2), fine for CPU and for short packs, not for 32K-token packs.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention, CUDA, bf16/fp16
  only). Its signature changed between torch releases (``is_causal`` in 2.9-2.11,
  ``window_size`` later); both are handled.
- ``cudnn``: cuDNN's fused attention on the packed layout with ragged offsets
  (``aten._cudnn_attention_forward/backward``, the kernels behind SDPA's cuDNN backend; CUDA,
  bf16/fp16, cuDNN >= 9). At head_dim 256 on the H200 it runs the 8K causal forward 2x and the
  backward 1.5x faster than flash attention 2 (scripts/bench_attention.py,
  docs/benchmarks/README.md session 7). k/v are repeated to the query heads first.
- ``auto``: ``varlen`` for packed CUDA bf16/fp16 inputs, else ``sdpa``.
Asking for a backend that cannot run raises; ``auto`` falling back logs once, loudly.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "varlen", "cudnn")
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_available(q: torch.Tensor) -> str | None:
    """None if the varlen backend can run on q, else the reason it cannot."""
    if not q.is_cuda:
        return "varlen attention needs CUDA tensors"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"varlen attention needs bf16/fp16, got {q.dtype}"
    if _varlen_fn() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} unknown; choose one of {BACKENDS}")
    packed = cu_seqlens is not None
    if backend == "cudnn":
        reason = cudnn_unavailable(q) or (None if packed and max_seqlen is not None else
                                          "needs a packed row (cu_seqlens and max_seqlen)")
        if reason is not None:
            raise RuntimeError(f"attention backend 'cudnn' cannot run: {reason}; use auto or varlen")
        if k.shape[1] != q.shape[1]:  # the ragged path takes equal head counts; autograd sums dk, dv back
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return _CudnnRagged.apply(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    if backend in ("auto", "varlen") and packed:
        reason = varlen_available(q)
        if reason is None and max_seqlen is not None:
            return _varlen(q, k, v, cu_seqlens, max_seqlen, causal, scale)
        if backend == "varlen":
            raise RuntimeError(f"attention backend 'varlen' cannot run: {reason or 'max_seqlen missing'}")
        if q.is_cuda:
            _warn_once(f"attention: falling back to SDPA with a block-diagonal mask ({reason})")
    if packed:
        return _sdpa_packed(q, k, v, cu_seqlens, causal, scale)
    return _sdpa_batched(q, k, v, causal, scale)


def _sdpa_batched(q, k, v, causal, scale):
    # [B, S, H, D] -> [B, H, S, D]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def block_diagonal_mask(cu_seqlens: torch.Tensor, total: int, causal: bool) -> torch.Tensor:
    """[T, T] bool mask: True where query i may attend key j (same sample, j <= i if causal)."""
    pos = torch.arange(total, device=cu_seqlens.device)
    seg = torch.bucketize(pos, cu_seqlens[1:].to(pos.dtype), right=True)
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= pos[:, None] >= pos[None, :]
    return mask


def _sdpa_packed(q, k, v, cu_seqlens, causal, scale):
    total = q.shape[0]
    mask = block_diagonal_mask(cu_seqlens, total, causal)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


@functools.cache
def _varlen_params() -> frozenset[str]:
    # read once: inspect.signature costs tens of microseconds of host time per call
    return frozenset(inspect.signature(_varlen_fn()).parameters)


def _varlen(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    fn = _varlen_fn()
    params = _varlen_params()
    kwargs = {"scale": scale}
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        kwargs["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def cudnn_unavailable(q: torch.Tensor) -> str | None:
    """None if the cuDNN ragged backend can run on q, else why not."""
    if not q.is_cuda:
        return "cuDNN attention needs CUDA tensors"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN attention needs bf16/fp16, got {q.dtype}"
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < 90000:
        return f"cuDNN >= 9.0 is needed, found {version}"
    if not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        return f"torch {torch.__version__} has no aten._cudnn_attention_forward"
    return None


class _CudnnRagged(torch.autograd.Function):
    """cuDNN attention over a packed row: q [T, H, D], k/v [T, Hkv, D], one causal (or full)
    block per segment of ``cu_seqlens``. No host sync: ``max_seqlen`` is a host int from the
    collate (or the row length under CUDA graphs)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, causal, scale):
        cu = cu_seqlens.to(torch.int32)
        out = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_seqlen, max_seqlen, True, 0.0, causal, False, scale=scale)
        o, lse, seed, offset = out[0], out[1], out[6], out[7]
        ctx.save_for_backward(q, k, v, o, lse, seed, offset, cu)
        ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse, seed, offset, cu = ctx.saved_tensors
        n = ctx.max_seqlen
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), q, k, v, o, lse, seed, offset, None, cu, cu, n, n, 0.0, ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None
