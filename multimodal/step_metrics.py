"""The log steps of the training loop: what a step adds to the window, the reductions queued on
the device at a log step (``start_log``), and the row written one step later (``emit``), when
reading the values back no longer stalls the device.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from core.transfer import to_device_async
from multimodal.flops import training_flops
from multimodal.nonfinite import NonFiniteGuard
from multimodal.observability.metrics import MetricsSink
from multimodal.observability.step_clock import StepClock
from multimodal.platform import Runtime
from multimodal.transforms import graphs_of

log = logging.getLogger(__name__)


class Window:
    """Host-side counts (real tokens, FLOPs) over the steps since the last log line."""

    def __init__(self):
        self.steps = 0
        self.tokens = 0
        self.flops = 0.0

    def add(self, batches: list[dict], model_cfg) -> None:
        self.steps += 1
        for b in batches:
            self.tokens += b["num_real_tokens"]
            grids = [tuple(g) for g in b["image_grid_thw"].tolist()]
            self.flops += training_flops(model_cfg, b["sample_lengths"], grids, b.get("lm_head_tokens"),
                                         b.get("mtp_head_tokens"))


@dataclass
class PendingLog:
    """A log step's metrics, read later by ``emit``: ``values`` is a host buffer that a
    non-blocking copy fills once the device reaches the end of that step (the clock's end mark,
    recorded after the copy, says when)."""
    it: int
    values: torch.Tensor          # [loss_sum, supervised tokens, real tokens, FLOPs, param norm, grad norm,
                                  #  the non-finite guard's counters]
    grad_norm: float | None       # when the optimizer gave a host value (else it is in ``values``)
    host: dict                    # lr, CUDA-graph counters, steps in the window
    window: tuple                 # (start, end) marks of StepClock
    clock: StepClock
    ready: object = None          # CUDA event after the staged copy on the update stream (overlapped only)


def start_log(it, report, grad_norm, scheduler, window: Window, clock: StepClock, chunks: list, rt: Runtime,
              processed_per_step: int, overlap=None, guard_counters=None) -> PendingLog:
    """Queue this log step's reductions (collectives and norms) on the device; read nothing back."""
    dp_group = ps.get_data_parallel_group()
    # Every pipeline stage of a DP replica reads the same micro-batches, so tokens and FLOPs are
    # counted once per replica (summed over DP only); only the last stage has the loss, which
    # reaches rank 0 (first stage) by one broadcast over the pipeline group, at log steps only.
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(report, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    if ps.get_context_parallel_world_size() > 1:  # each CP rank holds the loss of its own tokens
        dist.all_reduce(report, group=ps.get_context_parallel_group())
    # the host counts go through pinned memory: torch.tensor(..., device=cuda) copies from pageable
    # memory, which waits for the whole queued step and leaves the GPU idle while the host then
    # prepares the next batch
    counts = to_device_async(torch.tensor([window.tokens, window.flops], dtype=torch.float64), report.device)
    totals = torch.cat([report[:2].double(), counts, report[2:].double()])  # MTP [sum, tokens] at the end
    dist.all_reduce(totals, group=dp_group)  # loss and tokens of the whole data-parallel batch
    host = {"lr": scheduler.get_lr(scheduler.optimizer.param_groups[0]), "steps": window.steps,
            "processed_tokens": window.steps * processed_per_step}
    routers = graphs_of(chunks)
    if routers:  # micro-batches that ran eager layers instead (logged once per reason)
        host["cuda_graph_eager_batches"] = sum(sum(g.eager_batches.values()) for g in routers)
        host["cuda_graph_captures"] = sum(g.captures for g in routers)
        host["cuda_graph_capture_s"] = round(sum(g.capture_s for g in routers), 3)
    on_device = torch.is_tensor(grad_norm)
    # with the update overlapped, the parameters are final only on its stream: the norm and the
    # copy queue there, so the compute stream does not wait for the whole update
    with overlap.behind_update(totals, grad_norm) if overlap is not None else nullcontext():
        norm = param_norm(*chunks)  # of this step's parameters, before the next step changes them
        g = grad_norm.reshape(1).to(totals) if on_device else totals.new_zeros(1)
        extra = [guard_counters.to(totals)] if guard_counters is not None else []  # nonfinite.COUNTERS
        values = torch.cat([totals[:4], norm.reshape(1).to(totals), g, *extra, totals[4:]])
        # not .cpu(): that waits for everything queued so far, here and again at the read below
        staged = torch.empty(values.shape, dtype=values.dtype, pin_memory=rt.is_cuda)
        staged.copy_(values, non_blocking=True)
        ready = None
        if overlap is not None and overlap.stream is not None:  # else the clock's end mark, recorded
            ready = torch.cuda.Event()                           # after the copy on its stream, covers it
            ready.record()
    host_grad = None if on_device or grad_norm is None else float(grad_norm)
    if grad_norm is None:
        host["no_grad_norm"] = True
    return PendingLog(it, staged, host_grad, host, clock.mark(), clock, ready)


class _AllocRetries:
    """The CUDA caching allocator's retries so far (``num_alloc_retries``): a request it could not
    serve from its cache or from free device memory makes it free every cached block and try
    again, a synchronizing cudaFree, so a run near the memory limit slows down without failing.
    Warned once, when the count first rises."""

    warned = False

    @classmethod
    def count(cls, step: int) -> int:
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        if retries and not cls.warned:
            cls.warned = True
            log.warning("the CUDA caching allocator hit the memory limit %d time(s) by step %d; each time it "
                        "frees its cache and synchronizes the GPU, which slows those steps: set "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation) or lower the memory "
                        "(docs/performance.md#memory)", retries, step)
        return retries


def emit(p: PendingLog, peak, sink: MetricsSink, result, guard: NonFiniteGuard | None = None) -> None:
    elapsed = p.clock.seconds(*p.window)  # waits for the window's end mark
    if p.ready is not None:
        p.ready.synchronize()  # the staged copy is done (on the update stream, it may end later)
    totals = p.values.tolist()
    if p.grad_norm is not None:
        grad_norm = p.grad_norm
    else:
        grad_norm = float("nan") if p.host.get("no_grad_norm") else totals[5]
    world = dist.get_world_size()
    tflops_per_gpu = totals[3] / elapsed / world / 1e12
    metrics = {
        "step": p.it,
        # no supervised token left in the window: every step of it was skipped (non-finite)
        "loss": totals[0] / totals[1] if totals[1] > 0 else float("nan"),
        "grad_norm": grad_norm,
        "lr": p.host["lr"],
        "tokens_per_s": totals[2] / elapsed,
        "tflops_per_gpu": tflops_per_gpu,
        "mfu": tflops_per_gpu / peak if peak else None,
        "mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if p.clock.is_cuda else cpu_peak_gib(),
        "step_time_s": elapsed / max(p.host["steps"], 1),
        "supervised_tokens": int(totals[1]),
        "param_norm": totals[4],
        # real tokens / tokens processed (padding included): how full the packed rows were
        "real_token_fraction": totals[2] / max(p.host["processed_tokens"], 1),
    }
    if p.clock.is_cuda:  # cumulative over the process, like the data counts
        metrics["alloc_retries"] = _AllocRetries.count(p.it)
    if totals[-1] > 0:  # model.mtp_num_layers: the mean MTP loss over its shifted supervised tokens
        metrics["mtp_loss"] = totals[-2] / totals[-1]
    if not result.losses:  # this process's first row: how long from its start until that step was done
        metrics["startup_s"] = round(time.time() - psutil.Process().create_time(), 1)
        log.info("step %d done %.1f s after the process started (model build, kernel compilation and "
                 "graph capture included)", p.it, metrics["startup_s"])
    metrics.update({k: v for k, v in p.host.items() if k.startswith(("cuda_graph", "rows_", "val_", "data_"))})
    error = None
    if guard is not None:
        guard_metrics, error = guard.review(p.it, totals[6:-2])
        metrics.update(guard_metrics)
        guard.record(p.it, metrics["loss"], grad_norm)
    result.losses[p.it] = metrics["loss"]
    sink.log(p.it, metrics)
    if error is not None:  # after the row: the log shows the skipped steps that stopped the run
        raise error


def data_counts(batches) -> dict:
    """This rank's rows read and skipped so far (by reason), for the log row."""
    source = getattr(batches, "iterator", batches)  # under the prefetch thread: its loader
    summary = source.summary() if hasattr(source, "summary") else None
    if summary is None:
        return {}
    out = {"rows_read": summary["rows_read"], "rows_skipped": summary["rows_skipped"]}
    if summary["skipped_by_reason"]:
        out["rows_skipped_by_reason"] = summary["skipped_by_reason"]
    if hasattr(batches, "wait_s"):  # the prefetch thread: how long the trainer waited on it in all
        out["data_wait_s"] = round(batches.wait_s, 3)
    return out


def log_data_summary(batches) -> None:
    counts = data_counts(batches)
    if counts:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(counts.get("rows_skipped_by_reason", {}).items()))
        log.info("data: %d rows read, %d skipped%s (data-parallel rank %d)", counts["rows_read"],
                 counts["rows_skipped"], f" ({reasons})" if reasons else "", ps.get_data_parallel_rank())


def param_norm(*modules) -> torch.Tensor:
    """L2 norm of all parameters, each counted once across tensor-parallel ranks and pipeline
    stages (the tied output weight copy on the last stage is marked shared), as a device scalar
    (log steps only). One multi-tensor norm per dtype group: a per-parameter float/square/sum cost
    three kernels and an fp32 copy of every parameter."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for module in modules for p in module.parameters()]
    device = params[0].device
    dense, expert = [], []  # expert weights (allreduce=False) are split over EP, not replicated
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p):
            (dense if getattr(p, "allreduce", True) else expert).append(p.detach())
    sums = [_sum_of_squares(x, device) for x in (dense, expert)]
    dist.all_reduce(sums[0], group=ps.get_model_parallel_group())
    dist.all_reduce(sums[1], group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return (sums[0] + sums[1]).sqrt()


def _sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():  # fp32 accumulation whatever the parameter dtype
        total += torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).square().sum()
    return total


def cpu_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
