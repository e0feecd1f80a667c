"""CUDA graphs for the decoder layers (``train.cuda_graphs``).

Why: on the 2B recipe the GPU idled ~40% of each step because the host could not issue the
~4,800 kernels of a step fast enough (docs/kernels.md, CUDA graphs). A CUDA graph per
decoder layer and direction replays all of a layer's kernels with one host call.

How:
- Static inputs. A graph replays fixed addresses and shapes, so every micro-batch's layer
  metadata is copied (on the device, no host sync) into buffers of one fixed shape:
  ``cu_seqlens`` padded with empty segments at the end up to ``max_samples`` segments, the GDN
  chunk table (``fused_kernels.gated_delta_rule.GDNVarlen``) padded to its largest possible length
  with rows that point at an always-empty segment (every kernel masks them out), ``max_seqlen``
  fixed at the row length, and the MRoPE positions. Real rows and segments are unchanged, so the
  numbers are the eager ones.
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
import sys
import time
from collections import Counter

import torch

from fused_kernels.gated_delta_rule import FLA_CHUNK_SIZE, GDNVarlen
from models.performance.main_grad_add import add_into_main_grads
from models.common.packed_seq import PackedRowParams, cp_info, segment_boundaries

log = logging.getLogger(__name__)
WARMUP_ITERS = 2


class StaticBatch:
    """Fixed-shape device buffers for one packed row of ``seq`` tokens with at most
    ``max_samples`` segments; ``load`` fills them from a micro-batch's PackedRowParams."""

    def __init__(self, seq: int, max_samples: int, rope: torch.Tensor, device, one_segment: bool = False,
                 flash_qla_heads: int | None = None):
        """``one_segment``: metadata for rows that hold one sample; ``max_seqlen`` is then exact
        and attention may take its offset-free path (PackedRowParams.one_segment).
        ``flash_qla_heads``: the GDN layers' value heads when they run FlashQLA (its fixed plan)."""
        self.seq, self.max_samples = seq, max_samples
        n_cu = max_samples + 2  # segment ``max_samples`` is always empty: the padding rows' target
        self.cu32 = torch.full((n_cu,), seq, dtype=torch.int32, device=device)
        self.cu64 = torch.full((n_cu,), seq, dtype=torch.int64, device=device)
        # sum over samples of ceil(len / chunk) <= seq / chunk + samples
        self.chunks = torch.zeros((seq // FLA_CHUNK_SIZE + max_samples, 2), dtype=torch.int64, device=device)
        self.rope = torch.zeros_like(rope)
        self.qla = None  # FlashQLA's fixed-shape plan, when that GDN backend runs
        if flash_qla_heads is not None:
            from fused_kernels.flash_qla_gdr import StaticPlan

            self.qla = StaticPlan(self.cu64, self.chunks, seq, flash_qla_heads, one_segment)
        self.params = PackedRowParams(
            qkv_format="thd", cu_seqlens_q=self.cu32, cu_seqlens_kv=self.cu32, cu_seqlens_q_padded=self.cu32,
            cu_seqlens_kv_padded=self.cu32, max_seqlen_q=seq, max_seqlen_kv=seq,
            gdn_varlen=GDNVarlen(self.cu64, self.chunks, None if self.qla is None else self.qla.plan,
                                 qla_heads=flash_qla_heads),
            static_shape=not one_segment)

    def refusal(self, params, rope) -> str | None:
        """None if this micro-batch fits the buffers, else why not."""
        if rope is None or rope.shape != self.rope.shape or rope.dtype != self.rope.dtype:
            return "MRoPE input of another shape"
        samples = segment_boundaries(params).numel() - 1
        if samples > self.max_samples:
            return f"more than train.cuda_graphs.max_samples={self.max_samples} samples in a row"
        varlen = params.gdn_varlen
        if varlen is None:
            return "no GDN chunk table (the model family's packed_row_extras builds one for packed rows)"
        if varlen.chunk_indices.shape[0] > self.chunks.shape[0]:
            return "a GDN chunk table longer than the static one"
        return None

    def load(self, params, rope) -> None:
        """Copy a micro-batch's metadata in (device to device, no host sync)."""
        cu = segment_boundaries(params)
        n = cu.numel()
        self.cu32[:n].copy_(cu, non_blocking=True)
        self.cu32[n:].fill_(self.seq)
        self.cu64.copy_(self.cu32, non_blocking=True)
        chunks = params.gdn_varlen.chunk_indices
        self.chunks[: chunks.shape[0]].copy_(chunks, non_blocking=True)
        self.chunks[chunks.shape[0]:, 0].fill_(self.max_samples)  # the empty segment: masked out
        self.chunks[chunks.shape[0]:, 1].fill_(0)
        self.rope.copy_(rope, non_blocking=True)
        if self.qla is not None:
            self.qla.load()


class LayerGraph:
    """One layer's forward and backward graphs and their static tensors."""

    def __init__(self, params: list[torch.nn.Parameter], fused: set[int], to_main_grad: bool = False):
        self.params = params
        self.fused = fused  # indices into params whose weight gradient the graph adds to main_grad
        # to_main_grad: the backward graph also adds every other parameter gradient it computes into
        # main_grad (``added``, filled at capture), instead of handing autograd a static copy that
        # AccumulateGrad clones and DDP's hook then adds: two passes over the gradients saved
        self.to_main_grad = to_main_grad
        self.added: set[int] = set()
        self.fwd = self.bwd = None
        self.static_in = self.static_out = self.static_grad_out = None
        self.static_grads: tuple = ()

    def param_grads(self) -> list:
        out = []
        for i, (p, g) in enumerate(zip(self.params, self.static_grads[1:])):
            if i in self.fused or i in self.added:
                # megatron's convention for a gradient already in main_grad: a placeholder the
                # DDP hook skips because of the flag (a fresh tensor, so autograd does not copy it)
                p.grad_added_to_main_grad = True
                out.append(torch.empty_like(p))
            else:
                out.append(g)
        return out


class Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: LayerGraph, hidden: torch.Tensor, *params):
        ctx.graph = graph
        graph.static_in.copy_(hidden)
        graph.fwd.replay()
        return graph.static_out.detach()

    @staticmethod
    def backward(ctx, grad):
        graph = ctx.graph
        graph.static_grad_out.copy_(grad)
        graph.bwd.replay()
        return (None, graph.static_grads[0], *graph.param_grads())


@contextlib.contextmanager
def _fla_cache_off():
    """fla memoises per-tensor metadata (chunk offsets) by object identity; over static buffers
    whose contents change that would bake the warm-up batch's values into the graphs."""
    module = sys.modules.get("fla.utils")
    if module is None:
        yield
        return
    saved = getattr(module, "FLA_DISABLE_TENSOR_CACHE", False)
    module.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        module.FLA_DISABLE_TENSOR_CACHE = saved


def count_eager(counter: Counter, reason: str, what: str) -> None:
    """Count a micro-batch that runs eagerly instead of through graphs; warn once per reason."""
    if reason not in counter:
        log.warning("CUDA graphs: a micro-batch runs the eager %s (%s); counted in cuda_graph_eager_batches",
                    what, reason)
    counter[reason] += 1


def failure_summary(e: Exception) -> str:
    """A capture failure in one line: the exception type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


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
                             one_segment=kind == ONE_SEGMENT, flash_qla_heads=flash_qla_heads(self.layers))
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
        with _fla_cache_off():
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


def flash_qla_heads(layers) -> int | None:
    """The value heads of the layers' GDN modules when they run FlashQLA, else None (the graphs
    then give FlashQLA a fixed-shape plan, fused_kernels/flash_qla_gdr.StaticPlan)."""
    for layer in layers:
        for module in layer.modules():
            if getattr(module, "kernel_backend", None) == "flash_qla":
                return module.num_v_heads_local_tp
    return None


def graph_backward(graph: LayerGraph):
    """The backward a graph captures: input and parameter gradients. With ``graph.to_main_grad``
    each parameter gradient is added into its main_grad here and not returned (None).

    Only for parameters used inside the graph alone (a decoder layer's, the vision blocks'): autograd
    would otherwise sum the placeholder with the gradient from outside, which the flagged DDP hook
    then drops. Parameters without a gradient here (unused, or used only outside) are left alone."""
    # the test stand-in (EagerStandIn) re-runs the forward at each replay: use its latest output
    out = getattr(graph.fwd, "latest", graph.static_out)
    grads = torch.autograd.grad(out, graph_inputs(graph.static_in, graph.params), graph.static_grad_out,
                                allow_unused=True)
    if not graph.static_in.requires_grad:
        grads = (None, *grads)
    kept = [grads[0]]
    mains, to_add = [], []
    for j, (p, g) in enumerate(zip(graph.params, grads[1:])):
        if j in graph.fused:
            # megatron's placeholder (an unwritten weight-sized tensor): kept as a static output it
            # would hold graph-pool memory the size of every fused weight, never read (param_grads
            # hands autograd fresh ones).
            g = None
        elif graph.to_main_grad and g is not None and getattr(p, "main_grad", None) is not None:
            mains.append(p.main_grad)  # replayed: main_grad += this micro-batch's gradient
            to_add.append(g)
            graph.added.add(j)
            g = None
        kept.append(g)
    add_into_main_grads(mains, to_add)  # the small ones in two kernels, not one each
    return tuple(kept)


def graph_inputs(static_in: torch.Tensor, params) -> tuple:
    """What a captured backward differentiates: the parameters, and the input when it needs a
    gradient (a frozen vision tower's output does not: the backward then stops at the merger)."""
    return (static_in, *params) if static_in.requires_grad else tuple(params)


def record(graph, fn, pool):
    """Capture ``fn`` into ``graph`` and return its (static) outputs."""
    if isinstance(graph, torch.cuda.CUDAGraph):
        # On the trainer's own stream: the backward then meets DDP's gradient accumulator nodes
        # (created on that stream) without a cross-stream wait, which would invalidate the capture.
        # thread_local: the data loader's threads may pin host memory meanwhile.
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            return fn()
    return graph.capture(fn)


class EagerStandIn:
    """What a CUDA graph does, done eagerly, so the CPU tests run the whole graphed path (static
    buffers, replay node, gradient routing): ``capture`` runs ``fn`` and keeps its outputs as the
    static ones; ``replay`` runs it again and copies the results into them."""

    def capture(self, fn):
        self.fn = fn
        self.static = self.latest = fn()
        return self.static

    def replay(self):
        with torch.enable_grad():  # replay runs inside the autograd node's forward (no grad mode)
            self.latest = self.fn()
        with torch.no_grad():
            if isinstance(self.static, torch.Tensor):
                self.static.copy_(self.latest)
            else:
                for dst, src in zip(self.static, self.latest):
                    if dst is not None:
                        dst.copy_(src)


def refusal(cfg) -> str | None:
    """None if ``train.cuda_graphs`` can run with this config, else why not (for validate())."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not cfg.data.pack:
        return "needs data.pack=true (graphs replay one packed row of train.seq_length tokens)"
    if p.pp > 1 or p.tp > 1 or p.cp > 1:
        return "needs parallel.pp = tp = cp = 1 (data parallelism is fine)"
    # MoE decoder layers stay eager (decoder_layers_graphable): the graphs are the vision
    # encoder's only, and recompute of the eager decoder is fine
    if t.recompute_modules and decoder_layers_graphable(m) is None:
        return "cannot be combined with train.recompute_modules"
    if t.micro_batch_size != 1:
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
