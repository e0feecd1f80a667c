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
- ``cudnn``: cuDNN for every CUDA bf16/fp16 input: dense rows through SDPA's cuDNN backend,
  packed rows through cudnn-frontend's THD op (``torch.ops.cudnn.sdpa_fwd``, package
  ``nvidia-cudnn-frontend``), which hands cuDNN ragged offsets it computes itself. cuDNN's ragged
  path inside torch (``aten._cudnn_attention_*``) is not used: in torch 2.11 it returned wrong dq
  and then faulted.
- ``auto``, on CUDA bf16/fp16 with cuDNN >= 9 on Hopper or newer:
  - cuDNN dense for whatever needs no per-sample offsets: unpacked batches, and a packed row
    that the caller says is one segment (``one_segment``). On Hopper it is faster than flash
    attention 2 at both the decoder's and the vision encoder's head_dim (scripts/bench_attention.py,
    docs/kernels.md).
  - cuDNN THD for packed non-causal rows of a static shape (``static_shape``: the vision
    encoder's CUDA-graph buckets), where cudnn-frontend loads. It beats flash on the vision
    encoder's non-causal rows but not on the decoder's causal ones, so causal rows keep flash
    (scripts/bench_varlen_slots.py, docs/kernels.md). And a plan is built per shape (segment
    slots, ``max_seqlen`` bound, the backward also per token count), a cost of seconds, which
    eager micro-batches of ever new patch counts would pay again and again. ``max_seqlen`` is
    only an upper bound (the kernel masks by each segment's own length) and is rounded up to few
    bounds (``seqlen_bound``).
  - ``varlen`` for other packed rows; elsewhere ``sdpa``.
Asking for a backend that cannot run raises; ``auto`` falling back logs once, loudly.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

from models.common.buckets import bucket_rows

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
    one_segment: bool = False,
    static_shape: bool = False,
) -> torch.Tensor:
    """``one_segment``: the packed row is a single sample (the caller knows it on the host; under
    CUDA graphs ``max_seqlen`` is only an upper bound and cannot tell). ``static_shape``: the
    caller runs this shape again and again (a CUDA graph bucket), so per-shape plans pay off."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} unknown; choose one of {BACKENDS}")
    packed = cu_seqlens is not None
    if backend == "cudnn":
        return _cudnn_forced(q, k, v, causal, scale, cu_seqlens, max_seqlen)
    if backend == "auto" and (one_segment or not packed) and cudnn_dense_unavailable(q) is None:
        batched = (t[None] for t in (q, k, v)) if packed else (q, k, v)  # a packed row: one batch row
        out = _cudnn_dense(*batched, causal, scale)
        if out is not None:
            return out[0] if packed else out
    if (backend == "auto" and packed and static_shape and not causal and max_seqlen is not None
            and cudnn_packed_unavailable(q) is None):
        out = _cudnn_packed(q, k, v, cu_seqlens, max_seqlen, causal, scale)
        if out is not None:
            return out
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


_cudnn_refused: list[str] = []  # set once cuDNN refused an input: auto stops trying it
_cudnn_packed_refused: list[str] = []  # set once cuDNN's THD op refused an input: auto uses flash from then on


def _cudnn_forced(q, k, v, causal, scale, cu_seqlens, max_seqlen):
    """``backend="cudnn"``: cuDNN or a one-line error saying why it cannot run."""
    packed = cu_seqlens is not None
    reason = cudnn_packed_unavailable(q) if packed else cudnn_dense_unavailable(q)
    if reason is None and packed and max_seqlen is None:
        reason = "max_seqlen missing"
    if reason is not None:
        raise RuntimeError(f"attention backend 'cudnn' cannot run: {reason}; use attention_backend=auto")
    if packed:
        out = _cudnn_packed(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    else:
        out = _cudnn_dense(q, k, v, causal, scale)
    if out is None:
        raise RuntimeError(f"attention backend 'cudnn' refused the input: "
                           f"{(_cudnn_packed_refused if packed else _cudnn_refused)[0]}")
    return out


@functools.cache
def _cudnn_frontend() -> tuple[object | None, str | None]:
    """(cudnn-frontend's THD attention op, None), or (None, why it does not load)."""
    try:
        # registers torch.ops.cudnn.sdpa_fwd / sdpa_bwd and the forward's autograd
        import cudnn.sdpa.fwd.torch_op  # noqa: F401
    except ImportError:
        return None, "nvidia-cudnn-frontend is not installed (pip install -e \".[gpu]\")"
    except Exception as e:  # noqa: BLE001 - a broken install (libcudnn mismatch) must not stop training
        return None, f"nvidia-cudnn-frontend does not load ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return torch.ops.cudnn.sdpa_fwd, None


def cudnn_packed_unavailable(q: torch.Tensor) -> str | None:
    """None if cuDNN's packed (THD) attention can run on q, else why not."""
    reason = cudnn_dense_unavailable(q)
    if reason is None and _cudnn_packed_refused:
        reason = _cudnn_packed_refused[0]
    return reason or _cudnn_frontend()[1]


def seqlen_bound(n: int) -> int:
    """``max_seqlen`` rounded up for cuDNN's THD plans (``bucket_rows`` in units of 128: the vision
    graphs' row buckets are among the bounds), so eager micro-batches of every image size share a
    handful of plans. Query tiles past a segment's own length exit early."""
    return bucket_rows(n, 128)


def _cudnn_packed(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    """Packed [T, H, D] rows through cudnn-frontend's THD op, or None (after one warning) if it
    refuses. The forward returns its softmax statistics only when a backward will need them."""
    op = _cudnn_frontend()[0]
    bound = seqlen_bound(int(max_seqlen))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    # Token-major views (the vision blocks' q, k, v are slices of one [T, 3, H, D] tensor) go in
    # as copies: with them, the backward faulted on the H200 (an illegal address once a segment
    # began past the first third of the row, as if its dq accumulator were indexed by q's
    # strided offsets), while contiguous tensors match fp32 math (tests/gpu/test_cudnn_varlen_gpu.py).
    q, k, v = (t.contiguous() for t in (q, k, v))
    try:
        out, _ = op(q, k, v, scale, is_causal=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                    max_seqlen_q=bound, max_seqlen_kv=bound, return_lse=grad)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        _cudnn_packed_refused.append(f"cuDNN's THD attention refused an input ({str(e).splitlines()[0][:200]})")
        _warn_once(f"attention: cuDNN packed attention is off for this run, using flash varlen: "
                   f"{_cudnn_packed_refused[0]}")
        return None
    return out


def cudnn_dense_unavailable(q: torch.Tensor) -> str | None:
    """None if ``auto`` runs cuDNN's fused attention on q's device and dtype, else why not."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "needs bf16/fp16 tensors"
    return cudnn_device_unavailable(q.device)


def cudnn_device_unavailable(device: torch.device) -> str | None:
    """The device half of ``cudnn_dense_unavailable`` (also decides whether the CUDA graphs keep
    a separate set for one-sample rows)."""
    if device.type != "cuda":
        return "needs CUDA tensors"
    if _cudnn_refused:
        return _cudnn_refused[0]
    return _cudnn_device_reason(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cudnn_device_reason(device_index: int) -> str | None:
    """Checked once per device: every attention call of ``auto`` asks."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < 90000:
        return f"needs cuDNN >= 9.0 (found {version})"
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return "measured faster than flash attention on Hopper only"
    return None


_cudnn_gqa_refused: list[str] = []  # set once cuDNN refused grouped k/v heads: repeat them from then on


def _cudnn_dense(q, k, v, causal, scale):
    """[B, S, H, D] through SDPA's cuDNN backend alone; None (after one warning) if cuDNN refuses.
    Grouped k/v heads go in as they are (the kernel reads each for its query heads; repeating
    them costs a copy each way and a sum in the backward); if
    cuDNN refuses that, once, they are repeated."""
    if k.shape[2] != q.shape[2] and not _cudnn_gqa_refused:
        out = _cudnn_or_record(q, k, v, causal, scale, _cudnn_gqa_refused, "{}",
                               "attention: cuDNN refused grouped k/v heads ({}); repeating them")
        if out is not None:
            return out
    k, v = _repeat_kv(k, v, q.shape[2], dim=2)
    return _cudnn_or_record(q, k, v, causal, scale, _cudnn_refused, "cuDNN refused an input ({})",
                            "attention: cuDNN attention is off for this run, using flash attention: {}")


def _cudnn_or_record(q, k, v, causal, scale, refusals: list[str], reason: str, warning: str):
    """SDPA through cuDNN alone, or None after appending ``reason`` (formatted with cuDNN's error)
    to ``refusals`` and warning once with ``warning`` (formatted with that reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return _sdpa_batched(q, k, v, causal, scale)
    except RuntimeError as e:
        refusals.append(reason.format(str(e).splitlines()[0][:200]))
        _warn_once(warning.format(refusals[0]))
        return None


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
            k, v = _repeat_kv(k, v, q.shape[1], dim=1)
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _repeat_kv(k, v, q_heads: int, dim: int):
    """GQA without kernel support: repeat each k/v head for the query heads it serves (head h
    reads kv head h // rep); autograd sums dk, dv back."""
    rep = q_heads // k.shape[dim]
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=dim), v.repeat_interleave(rep, dim=dim))
