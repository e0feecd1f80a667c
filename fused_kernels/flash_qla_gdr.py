"""FlashQLA (the Qwen team's fused TileLang GDN kernels, ``pip install flash-qla``) as the delta
rule's backend: ``model.gdn_backend=flash_qla``.

Why: its forward and backward are a few fused kernels where fla runs a dozen, and it splits long
sequences into pieces that run side by side ("intra-card CP"), so 16 heads of one 8K sample
fill more than 16 of the H200's 132 SMs. tests/gpu/test_gdn_kernels_gpu.py measures it against fla.

What we add around it: FlashQLA decides the split by reading ``cu_seqlens`` on the host (a sync
per micro-batch) and rebuilds its chunk tables on the device. Here the trainer builds the whole
plan on the host, where the lengths already are (``plan_from_host``, called by
``GDNVarlen.flash_qla_plan`` at a micro-batch's first GDN call, from the host boundaries
``GDNVarlen.from_host`` keeps): FlashQLA's own split decision (its calibrated cost model), the
pieces, and the chunk tables, attached where FlashQLA looks for them
(``_flash_qla_prepared_varlen``, its documented fast path in ``flash_qla.utils.index``). CUDA
graphs replay fixed shapes, so the graphs get fixed plans (``StaticPlan``): rows of one sample use
a split fixed at capture; rows of several samples run unsplit, their chunk offsets recomputed on
the device at each load. Micro-batches the graphs replay never build a per-batch plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from core.transfer import to_device_async

CHUNK = 64


@functools.cache
def unusable_reason() -> str | None:
    """None if FlashQLA's forward and backward can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import flash_qla  # noqa: F401
        from flash_qla.ops.gated_delta_rule.chunk import CHUNK_SIZE
    except Exception as e:  # not installed, or no supported GPU/toolchain at import
        return f"flash_qla not importable ({type(e).__name__}: {e})"
    if CHUNK_SIZE != CHUNK:
        return f"FlashQLA uses {CHUNK_SIZE}-token chunks on this GPU; we support {CHUNK} (SM90/SM100)"
    return None


def shape_refusal(q: torch.Tensor, v: torch.Tensor) -> str | None:
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"FlashQLA needs bf16/fp16 q, k, v, got {q.dtype}"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"FlashQLA needs key and value head dims of 128, got {q.shape[-1]} and {v.shape[-1]}"
    return None


@dataclass
class QLAPlan:
    """FlashQLA's context for one packed row: its ``cp_context`` (unsplit or split into pieces)."""

    context: object

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.context.cu_seqlens


def _chunk_table(cu: list[int]) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(offsets [N+1], total chunks, indices [chunks, 2] = (segment, chunk in segment)) on the host."""
    counts = [(e - s + CHUNK - 1) // CHUNK for s, e in zip(cu[:-1], cu[1:])]
    offsets = torch.tensor([0] + counts).cumsum(0)
    seg = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    within = torch.arange(seg.numel()) - offsets[:-1][seg]
    return offsets, int(offsets[-1]), torch.stack([seg, within], 1)


def _attach_table(cu_dev: torch.Tensor, cu: list[int], total_bound: int | None = None) -> None:
    """Give ``cu_dev`` its chunk tables the way FlashQLA reads them (no device-to-host copies).
    ``total_bound``: the chunk count to report, when the tables are static buffers (graphs)."""
    offsets, total, indices = _chunk_table(cu)
    cu_dev._flash_qla_prepared_varlen = (
        CHUNK, to_device_async(offsets.to(cu_dev.dtype), cu_dev.device),
        total if total_bound is None else total_bound, to_device_async(indices.to(cu_dev.dtype), cu_dev.device))


def split_pieces(cu: list[int], max_chunks: int):
    """FlashQLA's intra-card split of a packed row: every segment longer than ``max_chunks`` chunks
    is cut into pieces of that many; returns (piece boundaries, piece -> segment, segment -> first
    piece, last piece of its segment?, first piece of its segment?). Empty segments get one empty piece."""
    bounds, c2r, r2c, last, first = [], [], [0], [], []
    step = max_chunks * CHUNK
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        starts = list(range(s, e, step)) or [s]
        for j, p in enumerate(starts):
            bounds.append(p)
            c2r.append(i)
            first.append(j == 0)
            last.append(j == len(starts) - 1)
        r2c.append(len(bounds))
    bounds.append(cu[-1])
    return bounds, c2r, r2c, last, first


def decide_split(cu: list[int], heads: int) -> int | None:
    """FlashQLA's own decision for these (non-empty) segments: the piece length in chunks, or None
    for no split."""
    from flash_qla.ops.gated_delta_rule.chunk.cp import context as qla_context
    from flash_qla.ops.gated_delta_rule.chunk.cp.autocp import decide

    chunks = [(e - s + CHUNK - 1) // CHUNK for s, e in zip(cu[:-1], cu[1:]) if e > s]
    if not chunks or not qla_context.AUTOCP_MODEL:
        return None
    use, lcp = decide(num_chunks=chunks, num_v_heads=heads, P=qla_context.MULTI_PROCESSOR_COUNT, chunk=CHUNK,
                      is_train=True)
    return lcp if use else None


def _context(cu_dev: torch.Tensor, cu: list[int], max_chunks: int | None):
    from flash_qla.ops.gated_delta_rule.chunk.cp import FlashQLACPContext

    if max_chunks is None:
        return FlashQLACPContext(cu_seqlens=cu_dev)
    bounds, c2r, r2c, last, first = split_pieces(cu, max_chunks)
    dev, dtype = cu_dev.device, cu_dev.dtype
    pieces = to_device_async(torch.tensor(bounds, dtype=dtype), dev)
    _attach_table(pieces, bounds)
    return FlashQLACPContext(
        is_intra=True, cu_seqlens=cu_dev, intra_cp_cu_seqlens=pieces,
        seq_map_r2c=to_device_async(torch.tensor(r2c, dtype=dtype), dev),
        seq_map_c2r=to_device_async(torch.tensor(c2r, dtype=dtype), dev),
        ht_mask=to_device_async(torch.tensor(last), dev), ht_mask_bwd=to_device_async(torch.tensor(first), dev))


def plan_from_host(cu_host: torch.Tensor, cu_dev: torch.Tensor, heads: int) -> QLAPlan:
    """The plan for one packed row, from its host ``cu_seqlens``; ``cu_dev`` is the same on the device."""
    cu = cu_host.tolist()
    _attach_table(cu_dev, cu)
    return QLAPlan(_context(cu_dev, cu, decide_split(cu, heads)))


class StaticPlan:
    """A fixed-shape plan for the CUDA graphs' static buffers (models/performance/layer_graphs.StaticBatch).

    ``one_segment``: the row is always one sample of ``seq`` tokens (then ``cu64`` never changes),
    split as FlashQLA would split it. Otherwise unsplit: segments vary, and a split would change
    the number of pieces; the chunk offsets are recomputed on the device by ``load``."""

    def __init__(self, cu64: torch.Tensor, chunks: torch.Tensor, seq: int, heads: int,
                 one_segment: bool):
        self.cu64 = cu64
        padded = [0] + [seq] * (cu64.numel() - 1)  # what load() leaves in cu64 for a one-sample row
        bound = chunks.shape[0]
        _attach_table(cu64, padded, total_bound=bound)
        self.offsets = cu64._flash_qla_prepared_varlen[1]
        # the graphs' own chunk table (padding rows point at an empty segment) is FlashQLA's too
        cu64._flash_qla_prepared_varlen = (CHUNK, self.offsets, bound, chunks)
        self.one_segment = one_segment
        self.plan = QLAPlan(_context(cu64, padded, decide_split(padded, heads) if one_segment else None))

    def load(self) -> None:
        """After ``cu64`` changed (device to device, no sync): recompute the chunk offsets."""
        if self.one_segment:
            return
        lens = self.cu64[1:] - self.cu64[:-1]
        torch.cumsum(torch.div(lens + CHUNK - 1, CHUNK, rounding_mode="floor"), 0, out=self.offsets[1:])


def chunk_gated_delta_rule(q, k, v, g, beta, plan: QLAPlan | None):
    """FlashQLA's delta rule (q, k l2-normed; scale 1/sqrt(K)); ``plan`` for packed rows, None for dense."""
    import flash_qla

    if plan is None:
        return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, auto_cp=False)[0]
    return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=plan.cu_seqlens, auto_cp=False,
                                            cp_context=plan.context)[0]
