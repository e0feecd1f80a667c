"""CUDA graphs for the decoder layers (``train.cuda_graphs``).

Why: the host cannot issue the thousands of small kernels of a step as fast as the GPU runs them,
so the GPU idles (docs/kernels.md, CUDA graphs). A CUDA graph per decoder layer and direction
replays all of a layer's kernels with one host call.

How:
- Static inputs. A graph replays fixed addresses and shapes, so every micro-batch's layer
  metadata is copied (on the device, no host sync) into buffers of one fixed shape:
  ``cu_seqlens`` padded with empty segments at the end up to ``max_samples`` segments (one more
  always empty, for padding to point at), ``max_seqlen`` fixed at the row length, the rotary
  positions, and what the family's mixers read beyond these: each registered family's
  ``graph_row_buffers`` (models/family.py) supplies those buffers for the layers it recognises.
  Real rows and segments are unchanged, so the numbers are the eager ones.
- Capture, once, at the first eligible micro-batch: a few eager warm-up passes of every layer
  (Triton autotuning, torch.compile), then the forward graphs of all layers in
  order and their backward graphs in reverse order, in one memory pool, which is the order
  training replays them in (PP = 1: each micro-batch's backward follows its forward).
- Replay: ``Replay`` is the autograd node of a graphed layer: forward copies the hidden state
  in and replays; backward copies the gradient in, replays, and hands autograd the input
  gradient and the parameter gradients. With ``model.grad_accum_fusion`` the linear layers'
  weight gradients are added into ``main_grad`` inside the backward graph; those parameters
  get megatron's usual placeholder gradient and flag, so DDP's hooks behave as without graphs.
- Fallback, loud and counted: a micro-batch the graphs cannot take (not a packed row, a
  different length, more samples than ``max_samples``, no grad) runs the eager layers, with
  one warning per reason; a capture that fails logs why and training stays eager.

Unsupported (config validation refuses them): CPU, pipeline, tensor or context parallelism,
MoE layers, selective recompute. The vision encoder has its own graphs, one per patch-count
bucket (models/qwen35_vl/vision_graphs.py); embeddings and loss stay eager.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections import Counter

import torch

from models.common.packed_seq import PackedRowParams, cp_info, segment_boundaries
# EagerStandIn: re-exported, the graph factory the CPU tests hand graph_decoder_layers
from models.performance.graph_replay import (WARMUP_ITERS, EagerStandIn, LayerGraph, Replay,  # noqa: F401
                                             count_eager, failure_summary, graph_backward, record)

log = logging.getLogger(__name__)


class StaticBatch:
    """Fixed-shape device buffers for one packed row of ``seq`` tokens with at most
    ``max_samples`` segments; ``load`` fills them from a micro-batch's PackedRowParams. What the
    family's layers read beyond the boundaries (a GDN layer's chunk table, say) comes from each
    registered family's ``graph_row_buffers`` for ``layers``."""

    def __init__(self, seq: int, max_samples: int, rope: torch.Tensor, device, one_segment: bool = False,
                 layers=()):
        """``one_segment``: metadata for rows that hold one sample; ``max_seqlen`` is then exact
        and attention may take its offset-free path (PackedRowParams.one_segment)."""
        from models import MODEL_REGISTRY

        self.seq, self.max_samples = seq, max_samples
        n_cu = max_samples + 2  # segment ``max_samples`` is always empty: the padding rows' target
        self.cu32 = torch.full((n_cu,), seq, dtype=torch.int32, device=device)
        self.cu64 = torch.full((n_cu,), seq, dtype=torch.int64, device=device)
        self.rope = torch.zeros_like(rope)
        made = (f.graph_row_buffers(layers, self.cu64, seq, max_samples, one_segment) for f in MODEL_REGISTRY.values())
        self.extras = [b for b in made if b is not None]
        fields = {k: v for b in self.extras for k, v in b.fields.items()}
        self.params = PackedRowParams(
            qkv_format="thd", cu_seqlens_q=self.cu32, cu_seqlens_kv=self.cu32, cu_seqlens_q_padded=self.cu32,
            cu_seqlens_kv_padded=self.cu32, max_seqlen_q=seq, max_seqlen_kv=seq, static_shape=not one_segment,
            **fields)

    def refusal(self, params, rope) -> str | None:
        """None if this micro-batch fits the buffers, else why not."""
        if rope is None or rope.shape != self.rope.shape or rope.dtype != self.rope.dtype:
            return "rotary input of another shape"
        samples = segment_boundaries(params).numel() - 1
        if samples > self.max_samples:
            return f"more than train.cuda_graphs.max_samples={self.max_samples} samples in a row"
        return next((r for r in (b.refusal(params) for b in self.extras) if r is not None), None)

    def load(self, params, rope) -> None:
        """Copy a micro-batch's metadata in (device to device, no host sync)."""
        cu = segment_boundaries(params)
        n = cu.numel()
        self.cu32[:n].copy_(cu, non_blocking=True)
        self.cu32[n:].fill_(self.seq)
        self.cu64.copy_(self.cu32, non_blocking=True)
        self.rope.copy_(rope, non_blocking=True)
        for b in self.extras:
            b.load(params)

    @contextlib.contextmanager
    def capturing(self):
        """The families' capture contexts, entered together."""
        with contextlib.ExitStack() as stack:
            for b in self.extras:
                stack.enter_context(b.capturing())
            yield


def _fused_linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in layer.modules() if getattr(m, "gradient_accumulation_fusion", False)
            and hasattr(getattr(m, "weight", None), "main_grad")]


class GraphSet:
    """The graphs of every decoder layer for one kind of row, and their static metadata."""

    def __init__(self, static: StaticBatch, graphs: list[LayerGraph]):
        self.static, self.graphs = static, graphs


PACKED, ONE_SEGMENT = "packed rows", "one-sample rows"


class DecoderGraphs:
    """Routes each decoder layer's forward through its graphs when the micro-batch fits.

    Two kinds of rows may get their own graph set (``one_segment_graphs``): a row holding one
    sample runs attention without offsets (cuDNN, models/common/attention.py), which a graph
    captured on a packed row cannot do, since its static ``max_seqlen`` is only a bound. Each kind
    is captured when first seen; the sets share one memory pool (their replays never overlap)."""

    def __init__(self, layers, max_samples: int, graph_factory=None, one_segment_graphs: bool = False,
                 grads_to_main_grad: bool = False):
        self.layers = list(layers)
        self.max_samples = max_samples
        self.one_segment_graphs = one_segment_graphs
        self.grads_to_main_grad = grads_to_main_grad
        self.eager = [layer.forward for layer in self.layers]
        self._new_graph = graph_factory or (lambda: torch.cuda.CUDAGraph())
        self.sets: dict[str, GraphSet] = {}
        self._pool = None
        self.failed: str | None = None
        self.eager_batches: Counter = Counter()  # reason -> micro-batches run eagerly
        self.graphed_batches = 0
        self.capture_s = 0.0  # host seconds spent warming up and capturing graph sets
        self._current = None  # the PackedRowParams the graphs hold this micro-batch, else None
        self._active: GraphSet | None = None
        for i, layer in enumerate(self.layers):
            layer.forward = functools.partial(self._forward, i)

    @property
    def captures(self) -> int:
        """Graph sets captured so far (a step that captures runs slower)."""
        return len(self.sets)

    @property
    def graphs(self) -> list[LayerGraph] | None:
        """The packed rows' layer graphs (or the only set's), None before any capture."""
        chosen = self.sets.get(PACKED) or next(iter(self.sets.values()), None)
        return None if chosen is None else chosen.graphs

    def close(self) -> None:
        """Give the layers their eager forward back and drop the graphs and their memory pool
        (the layers and this object reference each other; a later run in the same process, such
        as the benchmark's transformers baseline, needs that memory)."""
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        self.sets, self._pool, self._current, self._active = {}, None, None, None
        self.eager = []

    # ------------------------------------------------------------------ per micro-batch
    def _forward(self, i: int, hidden_states, **kw):
        params = kw.get("packed_seq_params")
        if i == 0:
            self._current = self._begin(hidden_states, kw)
        if self._current is None or params is not self._current:
            return self.eager[i](hidden_states=hidden_states, **kw)
        graph = self._active.graphs[i]
        return Replay.apply(graph, hidden_states, *graph.params), kw.get("context")

    def _kind(self, hidden, params) -> str:
        one = self.one_segment_graphs and params.one_segment(hidden.shape[0])
        return ONE_SEGMENT if one else PACKED

    def _begin(self, hidden, kw):
        reason = self._refusal(hidden, kw)
        kind = self._kind(hidden, kw["packed_seq_params"]) if reason is None else None
        if reason is None and kind not in self.sets:
            reason = self._try_capture(hidden, kw, kind)
        if reason is not None:
            count_eager(self.eager_batches, reason, "decoder layers")
            return None
        self._active = self.sets[kind]
        self._active.static.load(kw["packed_seq_params"], kw["rotary_pos_emb"])
        self.graphed_batches += 1
        return kw["packed_seq_params"]

    def _refusal(self, hidden, kw) -> str | None:
        if self.failed is not None:
            return f"capture failed: {self.failed}"
        if not (torch.is_grad_enabled() and self.layers[0].training):
            return "not training (no grad or eval mode)"
        params = kw.get("packed_seq_params")
        if not isinstance(params, PackedRowParams) or params.qkv_format != "thd" or cp_info(params) is not None:
            return "not a packed (THD) row"
        for key in ("attention_mask", "context", "inference_context", "attention_bias", "rotary_pos_cos",
                    "rotary_pos_sin", "rotary_pos_cos_sin", "sequence_len_offset"):
            if kw.get(key) is not None:
                return f"{key} is given"
        if hidden.dim() != 3 or hidden.shape[1] != 1:
            return "not one packed row"
        existing = self.sets.get(self._kind(hidden, params))
        if existing is not None:
            static_in = existing.graphs[0].static_in
            if hidden.shape != static_in.shape or hidden.dtype != static_in.dtype:
                return f"a row of {hidden.shape[0]} tokens, not {existing.static.seq} (train.seq_length)"
            return existing.static.refusal(params, kw.get("rotary_pos_emb"))
        return None

    # ------------------------------------------------------------------ capture
    def _try_capture(self, hidden, kw, kind: str) -> str | None:
        static = StaticBatch(hidden.shape[0], self.max_samples, kw["rotary_pos_emb"], hidden.device,
                             one_segment=kind == ONE_SEGMENT, layers=self.layers)
        reason = static.refusal(kw["packed_seq_params"], kw["rotary_pos_emb"])
        if reason is not None:
            return reason
        static.load(kw["packed_seq_params"], kw["rotary_pos_emb"])
        self._phase = "warm-up"
        start = time.perf_counter()
        try:
            graphs = self._capture(hidden, kw, static)
        except Exception as e:  # noqa: BLE001 - any capture failure: say so, train on eagerly
            self.failed = f"{self._phase}: {failure_summary(e)}"
            log.warning("CUDA graphs: capture failed, the decoder layers stay eager: %s", self.failed)
            self.sets, self._pool = {}, None
            gc.collect()  # the half-built graphs hold a private memory pool: give it back now
            if hidden.is_cuda:
                torch.cuda.empty_cache()
            return f"capture failed: {self.failed}"
        finally:
            self.capture_s += time.perf_counter() - start
        self.sets[kind] = GraphSet(static, graphs)
        log.info("CUDA graphs: captured %d decoder layers (forward and backward) for %s of %d tokens, "
                 "up to %d samples, in %.1f s", len(graphs), kind, static.seq, static.max_samples,
                 time.perf_counter() - start)
        return None

    def _capture(self, hidden, kw, static: StaticBatch) -> list[LayerGraph]:
        layer_kw = dict(kw, packed_seq_params=static.params, rotary_pos_emb=static.rope, padding_mask=None)
        fns = [functools.partial(self._layer_output, eager, layer_kw) for eager in self.eager]
        graphs = []
        for layer in self.layers:
            params = [p for p in layer.parameters() if p.requires_grad]
            fused_weights = {id(m.weight) for m in _fused_linears(layer)}
            graphs.append(LayerGraph(params, {j for j, p in enumerate(params) if id(p) in fused_weights},
                                     to_main_grad=self.grads_to_main_grad))
        fused_modules = [m for layer in self.layers for m in _fused_linears(layer)]
        flags = {id(p): getattr(p, "grad_added_to_main_grad", None) for g in graphs for p in g.params}
        on_gpu = hidden.is_cuda
        if on_gpu and torch.cuda.current_stream() == torch.cuda.default_stream():
            raise RuntimeError("the trainer must run on a side stream (see use_side_stream()); the capture would "
                               "join the default stream through DDP's gradient accumulator nodes")
        with static.capturing():
            # warm-up: eager passes with the plain weight-gradient path (it must not touch main_grad),
            # on the stream the graphs are captured on (cuBLAS workspaces, Triton autotuning)
            for m in fused_modules:
                m.gradient_accumulation_fusion = False
            try:
                x = hidden.detach()
                for fn, graph in zip(fns, graphs):
                    for _ in range(WARMUP_ITERS):
                        inp = x.clone().requires_grad_(True)
                        out = fn(inp)
                        torch.autograd.grad(out, (inp, *graph.params), torch.ones_like(out) * 1e-3,
                                            allow_unused=True)
                    x = out.detach()
                _warm_fused_wgrad(fused_modules, hidden)
            finally:
                for m in fused_modules:
                    m.gradient_accumulation_fusion = True
            if self._pool is None and on_gpu:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool
            for fn, graph in zip(fns, graphs):
                # zeros, not empty: the CPU stand-in really runs the capture pass, and a zero
                # input and output gradient make its fused main_grad adds exact no-ops
                graph.static_in = torch.zeros_like(hidden).requires_grad_(True)
                graph.fwd = self._new_graph()
                graph.static_out = record(graph.fwd, functools.partial(fn, graph.static_in), pool)
            for i, graph in reversed(list(enumerate(graphs))):
                self._phase = f"backward of layer {i}"
                graph.static_grad_out = torch.zeros_like(graph.static_out)
                graph.bwd = self._new_graph()
                graph.static_grads = record(graph.bwd, functools.partial(graph_backward, graph), pool)
        for g in graphs:  # capturing ran megatron's backward once: undo its flag side effects
            for p in g.params:
                if flags[id(p)] is not None:
                    p.grad_added_to_main_grad = flags[id(p)]
        return graphs

    @staticmethod
    def _layer_output(eager, layer_kw, x):
        return eager(hidden_states=x, **layer_kw)[0]


def _warm_fused_wgrad(modules, hidden) -> None:
    """Run the fused weight-gradient GEMM once per weight shape on scratch buffers: the warm-up
    passes use the plain path (the fused one would write into main_grad), and a GEMM's first
    call (cuBLAS heuristics, workspace) must not happen inside a capture."""
    from fused_kernels.wgrad_accum import wgrad_gemm_accum_fp32

    done = set()
    for m in modules:
        shape = tuple(m.weight.main_grad.shape)
        if shape in done or m.weight.main_grad.dtype != torch.float32:
            continue
        done.add(shape)
        tokens = hidden.shape[0] * hidden.shape[1]
        x = torch.zeros(tokens, shape[1], dtype=hidden.dtype, device=hidden.device)
        g = torch.zeros(tokens, shape[0], dtype=hidden.dtype, device=hidden.device)
        wgrad_gemm_accum_fp32(x, g, torch.zeros(shape, dtype=torch.float32, device=hidden.device))


def refusal(model_cfg, parallel_cfg, pack: bool, recompute_modules, micro_batch_size: int) -> str | None:
    """None if ``train.cuda_graphs`` can run with the recipe's ``model`` and ``parallel`` sections,
    ``data.pack``, ``train.recompute_modules`` and ``train.micro_batch_size``, else why not."""
    p = parallel_cfg
    if not pack:
        return "needs data.pack=true (graphs replay one packed row of train.seq_length tokens)"
    if p.pp > 1 or p.tp > 1 or p.cp > 1:
        return "needs parallel.pp = tp = cp = 1 (data parallelism is fine)"
    # MoE decoder layers stay eager (decoder_layers_graphable): the graphs are the vision
    # encoder's only, and recompute of the eager decoder is fine
    if recompute_modules and decoder_layers_graphable(model_cfg) is None:
        return "cannot be combined with train.recompute_modules"
    if micro_batch_size != 1:
        return "needs train.micro_batch_size=1 (one packed row per micro-batch)"
    return None


def decoder_layers_graphable(model_cfg) -> str | None:
    """None if ``train.cuda_graphs`` replays the decoder layers as graphs too, else why only the
    vision encoder's graphs run."""
    if model_cfg.num_experts:
        return ("MoE layers route a data-dependent number of tokens per expert (and megatron's "
                "router and dispatcher sync with the host), so the decoder layers stay eager")
    return None


def use_side_stream() -> torch.cuda.Stream:
    """Run this thread's GPU work on a new stream; call it before the model and DDP are built.

    A graph cannot be captured on the default stream, and the backward graphs must be captured
    on the stream where megatron's DDP created its gradient accumulator nodes (autograd syncs a
    node's stream with its producer's; across streams that wait breaks the capture). So the
    whole training runs on one side stream and the graphs are captured on it. Returns the stream
    that was current before, to restore when training ends. The stream has high priority: work
    queued on other streams (optimizer.overlap_step's update) takes only what it leaves free."""
    previous = torch.cuda.current_stream()
    torch.cuda.set_stream(torch.cuda.Stream(priority=-1))
    return previous


def one_segment_set_wanted(attention_backend: str, device: torch.device) -> bool:
    """Whether one-sample rows need their own graphs: only when ``auto`` attention gives them cuDNN."""
    from models.common.attention import cudnn_device_unavailable

    return attention_backend == "auto" and cudnn_device_unavailable(torch.device(device)) is None


def graph_decoder_layers(language_model, max_samples: int, graph_factory=None, one_segment_graphs: bool = False,
            grads_to_main_grad: bool = False) -> DecoderGraphs:
    """Route ``language_model``'s decoder layers through CUDA graphs (after the DDP wrap, so the
    fused weight-gradient path sees main_grad; ``use_side_stream()`` before the model is built).
    ``one_segment_graphs``: capture a second set for one-sample rows (their attention differs).
    ``grads_to_main_grad``: the backward graphs add the parameter gradients into main_grad."""
    return DecoderGraphs(language_model.decoder.layers, max_samples, graph_factory, one_segment_graphs,
                         grads_to_main_grad)
