"""What a CUDA graph of a layer (or a block of layers) is made of, shared by the decoder graphs
(models/performance/layer_graphs.py) and a family's own graphs (Qwen3.5's vision encoder):
its static tensors and the parameter gradients it hands autograd (``LayerGraph``), the autograd
node that replays it (``Replay``), the captured backward (``graph_backward``), the capture
itself (``record``), the eager stand-in the CPU tests capture with (``EagerStandIn``), and the
counted, warned fallback to eager (``count_eager``)."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from models.performance.main_grad_add import add_into_main_grads

log = logging.getLogger(__name__)
WARMUP_ITERS = 2  # eager passes per layer before a capture: Triton autotuning, torch.compile


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


def count_eager(counter: Counter, reason: str, what: str) -> None:
    """Count a micro-batch that runs eagerly instead of through graphs; warn once per reason."""
    if reason not in counter:
        log.warning("CUDA graphs: a micro-batch runs the eager %s (%s); counted in cuda_graph_eager_batches",
                    what, reason)
    counter[reason] += 1


def failure_summary(e: Exception) -> str:
    """A capture failure in one line: the exception type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


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
