"""CUDA graphs for the vision encoder's blocks and merger (``train.cuda_graphs``), one graph pair
per patch-count bucket.

Why: with the decoder layers replayed as graphs, the profile of the step shows the GPU
idle inside the eager vision encoder: a micro-batch's few hundred to few
thousand patches make kernels of microseconds, and the host spends longer issuing each of a
block's ~60 launches than the GPU spends running it (docs/kernels.md, CUDA graphs).

How:
- The patch count changes with every micro-batch, so the blocks' input is padded with zero rows
  up to a bucket (``bucket_rows``): a multiple of ``bucket`` patches up to 8 of them, then eight
  sizes per doubling, so padding costs at most 1/8 of the rows and a range of sizes needs few
  buckets (documents and photos of 224-1344 px, 1-4 per row: 13-23K patches, 8 buckets of 1024
  units, against 11 of plain 1024-patch multiples). Each bucket gets one forward and one backward
  graph, captured the first time it is seen (after two eager warm-up passes).
- The padding rows form one attention segment of their own, so no real patch attends to them,
  and their merger outputs are dropped: their gradient is zero and adds nothing to the weight
  gradients. Real rows compute what the eager encoder computes.
- Per-image segment offsets (``cu_seqlens``, padded with empty segments up to the bucket's slots)
  and the rotary positions are copied into each bucket's static buffers on the device. A bucket
  is a row count and a number of segment slots (``segment_slots``): 16, or ``max_images`` for
  micro-batches with more images. The packed attention kernels launch blocks for every slot,
  empty or not, of every head and query tile (the cost is in ``segment_slots``). The buckets'
  geometry says ``static_shape``, so ``attention_backend=auto`` runs their attention through
  cuDNN's THD kernels, whose per-shape plans are built once per bucket (models/common/attention.py).
- All buckets share one memory pool and one set of parameter-gradient buffers: a micro-batch's
  vision forward and backward end before the next micro-batch's begin, so the buckets'
  intermediate memory is never live at the same time. Another bucket costs its inputs, outputs
  and the graphs, not another copy of the activations or the gradients.
- Loud, counted fallback: more images than ``max_images``, more buckets than ``max_buckets``,
  no grad, or a failed capture run the eager blocks (one warning per reason, counted in
  ``cuda_graph_eager_batches``).

The patch embedding and the learned position embedding (a gather) stay eager: two kernels; the
patch embedding runs on the bucket's row count too (see ``_embed_padded``).
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections import Counter

import torch
import torch.nn.functional as F

from models.common.buckets import bucket_rows  # the padded row count of a micro-batch
from models.performance.graph_replay import (WARMUP_ITERS, LayerGraph, Replay, count_eager, failure_summary,
                                             graph_backward, graph_inputs, record)
from models.qwen35_vl.vision_geometry import VisionGeometry

log = logging.getLogger(__name__)


FEW_SEGMENTS = 16  # the segment slots of the buckets most micro-batches replay (``segment_slots``)


def segment_slots(segments: int, max_images: int) -> int:
    """The attention segment slots of the graph a micro-batch of ``segments`` images (or video
    frame pairs) replays: ``FEW_SEGMENTS``, or ``max_images`` beyond. Why not always
    ``max_images``: the varlen kernels' grid covers every slot, and each empty slot's blocks still
    start and exit, which adds up over the encoder's layers (scripts/bench_varlen_slots.py,
    docs/kernels.md)."""
    few = min(FEW_SEGMENTS, max_images)
    return few if segments <= few else max_images


def bucket_sizes(max_patches: int, unit: int) -> list[int]:
    """Every bucket a micro-batch of up to ``max_patches`` patches can land in, ascending."""
    return sorted({bucket_rows(p, unit) for p in range(unit, max_patches + unit, unit)})


class _Bucket:
    """Static inputs of one padded patch count: the rows, segment offsets and rotary positions."""

    def __init__(self, rows: int, slots: int, angles, device):
        self.rows, self.slots = rows, slots
        # the image segments, then the padding rows' segment, then the leading zero
        self.cu = torch.full((slots + 2,), rows, dtype=torch.int32, device=device)
        self.geo = VisionGeometry(cu_seqlens=self.cu, max_seqlen=rows, rot_pos=None, interp_index=None,
                                  interp_weight=None, static_shape=True)
        # fused rotary: (positions [3, N], inv_freq, section); reference rotary: angles [N, 1, D]
        if isinstance(angles, tuple):
            pos, inv, section = angles
            self.pos = torch.zeros((pos.shape[0], rows), dtype=pos.dtype, device=device)
            self.angles = (self.pos, inv.clone(), section)
        else:
            self.pos = torch.zeros((rows, *angles.shape[1:]), dtype=angles.dtype, device=device)
            self.angles = self.pos
        self.graph: LayerGraph | None = None

    def load(self, angles, geo: VisionGeometry, patches: int) -> None:
        """Copy a micro-batch's offsets and positions in (device to device, no host sync)."""
        n = geo.cu_seqlens.numel()
        self.cu[:n].copy_(geo.cu_seqlens, non_blocking=True)
        self.cu[n:].fill_(self.rows)  # segment n-1: the padding rows; the rest: empty
        if isinstance(angles, tuple):
            self.pos[:, :patches].copy_(angles[0], non_blocking=True)
            self.pos[:, patches:].zero_()
        else:
            self.pos[:patches].copy_(angles, non_blocking=True)
            self.pos[patches:].zero_()


class VisionGraphs:
    """Routes ``encoder.blocks_and_merger`` through per-bucket graphs when the micro-batch fits."""

    def __init__(self, encoder, bucket: int, max_buckets: int, max_images: int, graph_factory=None,
                 grads_to_main_grad: bool = False, warmup_patches: int = 0):
        if bucket % encoder.merge**2:
            raise ValueError(f"the vision graph bucket ({bucket} patches) must be a multiple of "
                             f"spatial_merge_size^2 = {encoder.merge**2}")
        self.encoder = encoder
        self.bucket, self.max_buckets, self.max_images = bucket, max_buckets, max_images
        self.eager = encoder.blocks_and_merger
        self.eager_embed = encoder.embed_patches
        self._new_graph = graph_factory or (lambda: torch.cuda.CUDAGraph())
        self.buckets: dict[tuple[int, int], _Bucket] = {}  # (rows, segment slots) -> its graphs
        self.params = [p for p in encoder.parameters() if p.requires_grad]
        self.grads: list[torch.Tensor] | None = None  # shared by every bucket's backward graph
        self.grads_to_main_grad = grads_to_main_grad  # see LayerGraph.to_main_grad
        self.pool = None
        self.failed: str | None = None
        self.eager_batches: Counter = Counter()
        self.graphed_batches = 0
        self.capture_s = 0.0  # host seconds spent warming up and capturing buckets
        # capture every bucket up to this many patches at the first training micro-batch
        self.warmup_patches = warmup_patches
        encoder.blocks_and_merger = self._run
        encoder.embed_patches = self._embed_padded

    @property
    def captures(self) -> int:
        """Buckets captured so far (a step that captures runs slower)."""
        return len(self.buckets)

    def close(self) -> None:
        """Give the encoder its eager blocks back and free the graphs, their pool and buffers."""
        self.encoder.__dict__.pop("blocks_and_merger", None)
        self.encoder.__dict__.pop("embed_patches", None)
        self.buckets, self.grads, self.pool = {}, None, None

    def _rows(self, patches: int) -> int:
        return bucket_rows(patches, self.bucket)

    def _embed_padded(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The eager patch embedding on the bucket's row count. With a new row count every step, the
        host spends time inside its addmm (most likely cuBLAS choosing a kernel for the new
        shape); the bucket's row counts repeat."""
        n = pixel_values.shape[0]
        return self.eager_embed(F.pad(pixel_values, (0, 0, 0, self._rows(n) - n)))[:n]

    def _run(self, x: torch.Tensor, angles, geo: VisionGeometry) -> torch.Tensor:
        if self.warmup_patches and self._refusal(geo, None) is None:
            self._capture_up_front(x, angles)
        rows = self._rows(x.shape[0])
        key = (rows, segment_slots(geo.cu_seqlens.numel() - 1, self.max_images))
        reason = self._refusal(geo, key)
        bucket = self.buckets.get(key)
        if reason is None and bucket is None:
            bucket, reason = self._try_capture(x, angles, geo, key)
        if reason is not None:
            count_eager(self.eager_batches, reason, "vision encoder")
            return self.eager(x, angles, geo)
        bucket.load(angles, geo, x.shape[0])
        self.graphed_batches += 1
        padded = F.pad(x, (0, 0, 0, rows - x.shape[0]))
        if bucket.graph.bwd is None:  # a frozen encoder: forward only
            bucket.graph.static_in.copy_(padded)
            bucket.graph.fwd.replay()
            out = bucket.graph.static_out.detach()
        else:
            out = Replay.apply(bucket.graph, padded, *self.params)
        return out[: x.shape[0] // self.encoder.merge**2]

    def _capture_up_front(self, like: torch.Tensor, angles) -> None:
        """Capture every bucket up to ``warmup_patches`` now, on synthetic rows shaped like ``like``
        (one attention segment, positions 0), so later steps never stop to capture
        (``train.cuda_graphs.vision_warmup_patches``). Only the ``FEW_SEGMENTS`` slots: a
        micro-batch of more images is captured when it comes."""
        limit, self.warmup_patches = self.warmup_patches, 0
        # largest first: the buckets share one memory pool, and each capture frees its activations
        # at the end of its backward, so smaller buckets reuse the blocks of larger ones; in
        # ascending order every bucket would need blocks larger than any freed so far
        sizes = sorted(bucket_sizes(limit, self.bucket), reverse=True)
        start, gen = time.perf_counter(), torch.Generator(device=like.device).manual_seed(0)
        reserved = torch.cuda.memory_reserved(like.device) if like.is_cuda else 0
        slots = segment_slots(1, self.max_images)
        for rows in sizes:
            if (rows, slots) in self.buckets or len(self.buckets) >= self.max_buckets:
                continue
            x = torch.randn(rows, like.shape[1], generator=gen, device=like.device, dtype=like.dtype)
            x.requires_grad_(like.requires_grad)  # the graphs differentiate their input as the real one needs
            cu = torch.tensor([0, rows], dtype=torch.int32, device=like.device)
            geo = VisionGeometry(cu_seqlens=cu, max_seqlen=rows, rot_pos=None, interp_index=None, interp_weight=None,
                                 static_shape=True)
            if isinstance(angles, tuple):
                fake = (torch.zeros((angles[0].shape[0], rows), dtype=angles[0].dtype, device=like.device),
                        angles[1], angles[2])
            else:
                fake = torch.zeros((rows, *angles.shape[1:]), dtype=angles.dtype, device=like.device)
            _bucket, reason = self._try_capture(x, fake, geo, (rows, slots))
            if reason is not None:
                return
        grown = (torch.cuda.memory_reserved(like.device) - reserved) / 2**30 if like.is_cuda else 0.0
        log.info("CUDA graphs: %d vision buckets up to %d patches captured before training in %.1f s "
                 "(GPU memory reserved grew by %.1f GiB)", len(self.buckets), limit, time.perf_counter() - start, grown)

    def _refusal(self, geo, key: tuple[int, int] | None) -> str | None:
        if self.failed is not None:
            return f"vision capture failed: {self.failed}"
        if not (torch.is_grad_enabled() and self.encoder.training):
            return "not training (no grad or eval mode)"
        if geo.cu_seqlens.numel() - 1 > self.max_images:
            # a segment is an image or one frame pair of a video (attention stays within it)
            return (f"more than train.cuda_graphs.max_samples={self.max_images} attention segments (images, "
                    "video frame pairs) in a micro-batch")
        if key is not None and key not in self.buckets and len(self.buckets) >= self.max_buckets:
            return (f"a {key[0]}-patch bucket beyond train.cuda_graphs.vision_max_buckets={self.max_buckets} "
                    "(raise it or train.cuda_graphs.vision_bucket)")
        return None

    def _try_capture(self, x, angles, geo, key: tuple[int, int]):
        bucket = _Bucket(*key, angles, x.device)
        bucket.load(angles, geo, x.shape[0])
        start = time.perf_counter()
        try:
            self._capture(bucket, x)
        except Exception as e:  # noqa: BLE001 - any capture failure: say so, train on eagerly
            self.failed = failure_summary(e)
            log.warning("CUDA graphs: vision capture failed, the encoder stays eager: %s", self.failed)
            self.buckets, self.grads, self.pool = {}, None, None
            gc.collect()
            if x.is_cuda:
                torch.cuda.empty_cache()
            return None, f"vision capture failed: {self.failed}"
        finally:
            self.capture_s += time.perf_counter() - start
        self.buckets[key] = bucket
        log.info("CUDA graphs: captured the vision encoder (forward and backward) for %d patches in up to "
                 "%d images (bucket %d of at most %d) in %.1f s", *key, len(self.buckets), self.max_buckets,
                 time.perf_counter() - start)
        return bucket, None

    def _capture(self, bucket: _Bucket, x: torch.Tensor) -> None:
        fn = functools.partial(self.eager, angles=bucket.angles, geo=bucket.geo)
        if self.grads is None:  # None: the graph adds that gradient to main_grad (or computes none)
            self.grads = [None if self.grads_to_main_grad and getattr(p, "main_grad", None) is not None
                          else torch.zeros_like(p) for p in self.params]
            self.pool = torch.cuda.graph_pool_handle() if x.is_cuda else None
        graph = LayerGraph(self.params, fused=set(), to_main_grad=self.grads_to_main_grad)
        if not self.params and not x.requires_grad:
            # model.freeze=[vision, merger]: nothing here trains, so the graph is forward only and
            # saves no activations for a backward (eager autograd records nothing here either)
            self._capture_forward_only(graph, fn, bucket, x)
            return
        # the input needs no gradient when what makes it is frozen (model.freeze=[vision]: only the
        # merger trains, and the backward stops there, as eager autograd's would)
        graph.static_in = torch.zeros((bucket.rows, x.shape[1]), dtype=x.dtype, device=x.device,
                                      requires_grad=x.requires_grad)
        with torch.no_grad():
            graph.static_in[: x.shape[0]].copy_(x)  # warm up on real rows (Triton autotuning sees real data)
        for _ in range(WARMUP_ITERS):
            out = fn(graph.static_in)
            torch.autograd.grad(out, graph_inputs(graph.static_in, self.params), torch.ones_like(out) * 1e-3,
                                allow_unused=True)
        del out
        with torch.no_grad():
            graph.static_in.zero_()
        graph.fwd = self._new_graph()
        graph.static_out = record(graph.fwd, functools.partial(fn, graph.static_in), self.pool)
        graph.static_grad_out = torch.zeros_like(graph.static_out)
        graph.bwd = self._new_graph()
        graph.static_grads = record(graph.bwd, functools.partial(self._backward_into_shared, graph), self.pool)
        bucket.graph = graph

    def _capture_forward_only(self, graph: LayerGraph, fn, bucket: _Bucket, x: torch.Tensor) -> None:
        graph.static_in = torch.zeros((bucket.rows, x.shape[1]), dtype=x.dtype, device=x.device)
        with torch.no_grad():
            graph.static_in[: x.shape[0]].copy_(x)
            for _ in range(WARMUP_ITERS):
                fn(graph.static_in)
            graph.static_in.zero_()
            graph.fwd = self._new_graph()
            graph.static_out = record(graph.fwd, functools.partial(fn, graph.static_in), self.pool)
        bucket.graph = graph

    def _backward_into_shared(self, graph: LayerGraph) -> tuple:
        grads = graph_backward(graph)  # with to_main_grad: None for what went into main_grad
        out = [grads[0]]
        for buf, g in zip(self.grads, grads[1:]):
            if buf is not None:
                if g is None:  # the patch and position embeddings: used outside the graph only
                    buf.zero_()
                else:
                    buf.copy_(g)
            out.append(buf)
        return tuple(out)


def graph_vision_encoder(encoder, bucket: int, max_buckets: int, max_images: int, graph_factory=None,
            grads_to_main_grad: bool = False, warmup_patches: int = 0) -> VisionGraphs:
    """Route ``encoder``'s blocks and merger through per-bucket CUDA graphs (``use_side_stream()``
    of models.performance.layer_graphs before the model is built, as for the decoder graphs)."""
    return VisionGraphs(encoder, bucket, max_buckets, max_images, graph_factory, grads_to_main_grad,
                        warmup_patches)
