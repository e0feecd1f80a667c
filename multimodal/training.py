"""The training loop: megatron-core DDP + optimizer + forward-backward schedule, our batches.

One step = ``num_microbatches`` micro-batches through megatron's forward_backward_func,
then one optimizer step. Loss, token counts and timings are accumulated on the device and
read back only every ``logging.interval`` steps, so the hot path has no host syncs of ours.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from data.loader import MicroBatchIterator, build_dataset, default_num_workers
from data.prefetch import Prefetcher
from models import get_hf_adapter, get_model_builder, get_model_family
from multimodal import checkpointing, hf_convert, platform
from multimodal.config import Config, ConfigError, resolve_sources, validate, vision_warmup_patches
from multimodal.context_parallel import sequence_pad_multiple
from core.errors import NonFiniteError
from core.transfer import to_device_async
from multimodal.evaluation import Evaluator
from multimodal.flops import device_peak_tflops, training_flops
from multimodal.forward_step import ForwardStep
from multimodal.loss import masked_token_loss
from multimodal.observability import oom_advice
from multimodal.observability.memory import MemoryTools
from multimodal.async_saves import AsyncSaves
from multimodal.observability.metrics import MetricsSink
from multimodal.nonfinite import NonFiniteGuard, weights_finite
from multimodal.optimizer import build_optimizer
from multimodal.performance import multi_tensor
from models.common.layout_init import init_layout_independent
from models.performance import layer_graphs, wgrad_fusion
from multimodal.platform import Runtime, init_distributed, use_deterministic_algorithms
from core.seeding import seed_everything
from multimodal.freeze import describe as describe_freeze
from multimodal.freeze import freeze
from multimodal.lora import apply_lora
from multimodal.observability.profiling import StepProfiler
from multimodal.observability.step_clock import StepClock

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    last_iteration: int = 0
    tokens: int = 0  # real tokens this rank's micro-batches held
    checkpoint: str | None = None  # the last one this run wrote


def resolve_dtype(precision: str, rt: Runtime) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if rt.is_cuda else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def build_model_and_optimizer(cfg: Config, rt: Runtime, dtype: torch.dtype):
    builder = get_model_builder(cfg.model.name)
    # Pipeline stages: the first embeds (vision encoder + token embedding), the last owns the
    # output layer and the loss; each builds only its own decoder layers.
    model = builder(cfg.model, cfg.parallel, dtype, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(), deterministic=cfg.train.deterministic)
    model.to(rt.device)
    if getattr(cfg.model, "init", "layout_independent") == "layout_independent":
        # on the device, before LoRA, freezing and DDP: the same train.seed gives the same model in any layout
        counts = init_layout_independent(model, cfg.train.seed)
        log.info("layout-independent init: %d tensors drawn, %d kept as built", counts["tensors"], counts["kept"])
    log.info(describe_freeze(freeze(model, cfg.model.freeze)))  # before DDP: no buffers for frozen weights
    if cfg.model.lora.rank:  # adapters added and every base weight frozen, before DDP as well
        log.info(apply_lora(model, cfg.model.lora))
    if cfg.train.recompute_modules:
        from multimodal.performance.recompute import apply_recompute

        apply_recompute(model, cfg.train.recompute_modules)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        average_in_collective=False,  # per-token loss: the one division is by the token count
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    eager_decoder = layer_graphs.decoder_layers_graphable(cfg.model)  # None: the decoder layers graph too
    # measured faster with graphed decoder layers; an eager (MoE) decoder keeps its default path
    graphs_add = (rt.is_cuda and cfg.train.cuda_graphs and cfg.train.cuda_graph_grads_to_main_grad
                  and eager_decoder is None)
    if wgrad_fusion.resolve(cfg.model.grad_accum_fusion, graphs_add):  # needs DDP's main_grad: after the wrap
        log.info("weight-gradient accumulation fusion: %d weights (linear layers, embedding, LM head)",
                 wgrad_fusion.enable(ddp))
    if cfg.train.cuda_graphs:  # after the fusion: the graphs capture its main_grad writes
        if not rt.is_cuda:
            raise ConfigError("train.cuda_graphs=true needs a GPU; set it to false here")
        t = cfg.train
        # one-sample rows take cuDNN attention under `auto` (models/common/attention.py): their own graphs
        one_segment = layer_graphs.one_segment_set_wanted(cfg.model.attention_backend, rt.device)
        if eager_decoder is None:
            model.decoder_graphs = layer_graphs.graph_decoder_layers(
                model.language_model, t.cuda_graph_max_samples, one_segment_graphs=one_segment,
                grads_to_main_grad=t.cuda_graph_grads_to_main_grad)
        else:
            log.info("CUDA graphs: vision encoder only; %s", eager_decoder)
        vision = getattr(model, "vision_model", None)
        if t.cuda_graph_vision_bucket and hasattr(vision, "install_cuda_graphs"):  # the model's own router
            model.vision_graphs = vision.install_cuda_graphs(t.cuda_graph_vision_bucket, t.cuda_graph_vision_max_buckets,
                                                             t.cuda_graph_max_samples,
                                                             grads_to_main_grad=t.cuda_graph_grads_to_main_grad,
                                                             warmup_patches=vision_warmup_patches(cfg))
    optimizer, scheduler = build_optimizer(cfg, model, ddp, dtype)
    # megatron's schedule calls these: DP grad reduction once per step, scaled once by the
    # total number of supervised tokens (calculate_per_token_loss).
    tcfg = model.config
    tcfg.no_sync_func = ddp.no_sync
    tcfg.finalize_model_grads_func = finalize_grads
    tcfg.grad_scale_func = optimizer.scale_loss
    check_gradient_scaling(ddp)
    return model, ddp, optimizer, scheduler


def _graphs_of(model) -> list:
    """The decoder's and the vision encoder's CUDA graph routers that training installed."""
    return [g for g in (getattr(model, "decoder_graphs", None), getattr(model, "vision_graphs", None)) if g is not None]


def finalize_grads(model, num_tokens, pg_collection=None, force_all_reduce=False):
    """megatron's finalize_model_grads, then one coalesced TP all-reduce (sum) of the grads of
    replicated parameters that only see this rank's heads (``tp_partial_grad``, set by the model
    builder). Sums commute with the DP reduction and the 1/tokens scaling done before, and under
    the distributed optimizer TP peers hold the same DP shard, so this is exact in every mode."""
    finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    tp_group = ps.get_tensor_model_parallel_group()
    if tp_group.size() == 1:
        return
    grads = [p.main_grad for chunk in model for p in chunk.parameters()
             if p.requires_grad and getattr(p, "tp_partial_grad", False)]
    if grads:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=tp_group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def check_gradient_scaling(ddp) -> None:
    """Fail at start-up on any setting that would scale gradients more than once.

    Our loss (multimodal.loss) returns the *sum* of masked token losses and the token count.
    With ``calculate_per_token_loss`` megatron-core 0.19.2 then: does not divide the loss by
    the micro-batch's tokens or by num_microbatches (schedules.forward_step_calc_loss), does
    not pre-scale the DP gradient reduction (DDP gradient_scaling_factor 1.0, SUM collective),
    sums the token counts over micro-batches, broadcasts them from the last pipeline stage and
    all-reduces them over DP x CP, and divides the gradients once by that total
    (finalize_model_grads, called by our finalize_grads). Any of the following would add a
    second factor (1/num_microbatches, 1/DP or 1/(DP*CP)) on top of 1/tokens, so each one is
    refused here.
    """
    cfg = ddp.config  # what the schedule reads (get_model_config)
    problems = []
    if not cfg.calculate_per_token_loss:
        problems.append("calculate_per_token_loss is False: megatron would divide our summed loss by its "
                        "token count and num_microbatches, and the DDP reduction by the DP size")
    if ddp.module.config is not cfg and not ddp.module.config.calculate_per_token_loss:
        problems.append("the model's config and the DDP wrapper's config disagree on calculate_per_token_loss")
    if ddp.ddp_config.average_in_collective:
        problems.append("DDP average_in_collective=True divides gradients by the DP size in the collective")
    for buf in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        if buf.gradient_scaling_factor != 1.0:
            problems.append(f"a DDP gradient buffer pre-scales gradients by {buf.gradient_scaling_factor}")
            break
    # our loss's side of the contract: a sum over supervised tokens, not a mean
    loss_sum, num_tokens, _ = masked_token_loss(torch.full((1, 4), 2.0), torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    if float(loss_sum) != 6.0 or int(num_tokens) != 3:
        problems.append(f"the loss function must return (sum of masked token losses, token count); got "
                        f"({float(loss_sum)}, {int(num_tokens)}) for 3 tokens of loss 2.0")
    if cfg.finalize_model_grads_func is not finalize_grads:
        problems.append("finalize_model_grads_func is not ours (megatron's finalize_model_grads + TP sums), so "
                        "the one division by the global token count would not happen (or would happen elsewhere)")
    if problems:
        raise RuntimeError("gradient scaling would not be exactly 1/(supervised tokens of the global batch): "
                           + "; ".join(problems))


def checkpoint_meta(cfg: Config) -> dict[str, str]:
    """Architecture files stored in every checkpoint (export reads them)."""
    meta = {"model_config.json": json.dumps(dataclasses.asdict(cfg.model), indent=1)}
    if cfg.model.hf_config:
        p = Path(cfg.model.hf_config)
        meta["hf_config.json"] = (p if p.is_file() else p / "config.json").read_text()
    return meta


def train(cfg: Config) -> TrainResult:
    rt = init_distributed()
    if cfg.parallel.moe_a2a_overlap and not rt.is_cuda and not platform.CPU_STREAM_STAND_INS:
        raise ConfigError("parallel.moe_a2a_overlap=true needs GPUs: megatron-core runs the overlapped "
                          "all-to-alls on their own CUDA streams; set parallel.moe_a2a_overlap=false here")
    resolve_sources(cfg)
    validate(cfg, rt.world_size)
    p = cfg.parallel
    hf_plan = None
    if cfg.checkpoint.load and hf_convert.is_hf_folder(cfg.checkpoint.load):
        # where each stored tensor sits in the TP=1 model: megatron reads its layout from the global
        # parallel state, so this is worked out before the run's own layout is set up
        hf_plan = hf_convert.reference_plan(cfg.model, get_model_family(cfg.model.name))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
    )
    try:
        return _train(cfg, rt, hf_plan)
    finally:
        ps.destroy_model_parallel()


def _train(cfg: Config, rt: Runtime, hf_plan=None) -> TrainResult:
    t = cfg.train
    seed_everything(t.seed)
    use_deterministic_algorithms(t.deterministic)
    # before the model is built, so the allocator history shows parameters and optimizer state too
    mem = MemoryTools(cfg.logging, rt.is_cuda, dist.get_rank()).start()
    dtype = resolve_dtype(t.precision, rt)
    previous_stream = None
    if t.cuda_graphs and rt.is_cuda:
        previous_stream = layer_graphs.use_side_stream()  # before DDP creates its gradient accumulator nodes
    try:
        return _build_and_loop(cfg, rt, dtype, mem, hf_plan)
    finally:
        if previous_stream is not None:
            torch.cuda.current_stream().synchronize()
            torch.cuda.set_stream(previous_stream)


def _build_and_loop(cfg: Config, rt: Runtime, dtype: torch.dtype, mem: MemoryTools, hf_plan=None) -> TrainResult:
    t, m = cfg.train, cfg.model
    # before anything is built: a mistyped checkpoint.load stops here, in a second, not after the model
    # (a Hugging Face folder is read directly into the model, ``hf_plan``)
    load_path = checkpointing.resolve(cfg.checkpoint.load, cfg.checkpoint.dir) \
        if cfg.checkpoint.load and hf_plan is None else None
    lineage = None
    if cfg.checkpoint.dir:  # a folder that cannot take this run's checkpoints stops it now, not at the first save
        checkpointing.check_writable(cfg.checkpoint.dir)
        lineage = checkpointing.start_run(cfg.checkpoint.dir, load_path, cfg.checkpoint.overwrite)
    model, ddp, optimizer, scheduler = build_model_and_optimizer(cfg, rt, dtype)
    if cfg.checkpoint.dir:
        checkpointing.check_free_space(cfg.checkpoint.dir, *checkpointing.estimate_bytes(model, rt.world_size))
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    num_microbatches = t.global_batch_size // (t.micro_batch_size * dp_size)
    if rt.is_main:
        n_params = sum(q.numel() for q in model.parameters())
        log.info("model %s: %.2fM parameters per rank, dtype %s, device %s, dp=%d, pp=%d, micro-batches/step=%d",
                 m.name, n_params / 1e6, dtype, rt.device, dp_size, cfg.parallel.pp, num_microbatches)

    if cfg.data.num_workers is None:  # resolved here, so the saved config says what ran
        cfg.data.num_workers = default_num_workers(rt.is_cuda)
        log.info("data: %d decode worker process(es) per rank (data.num_workers)", cfg.data.num_workers)
    dataset = build_dataset(m, cfg.data, t.seq_length)
    loader = MicroBatchIterator.from_config(dataset, m, cfg.data, t, dp_rank, dp_size,
                                            pad_multiple=sequence_pad_multiple(cfg))

    start, last_good = 0, None
    if hf_plan is not None:
        family = get_model_family(m.name)
        counts = hf_convert.load_hf_weights(model, cfg.checkpoint.load, m, get_hf_adapter(family), hf_plan)
        log.info("loaded %d tensors (%.2f GB on this rank) straight from the Hugging Face folder %s; optimizer "
                 "and step start fresh", counts["tensors"], counts["bytes"] / 1e9, cfg.checkpoint.load)
    if load_path is not None:
        start, data_state = checkpointing.load(load_path, model, optimizer, scheduler,
                                               model_config=dataclasses.asdict(m), trust=cfg.checkpoint.trust)
        last_good = str(load_path)
        if data_state is not None:
            loader.load_state_dict(data_state)
    if start == 0 and (hf_plan is not None or load_path is not None) and hasattr(optimizer, "reload_model_params"):
        # weights loaded after the optimizer was built: its fp32 main copies (bf16 training) are
        # still the initial weights until they are copied again
        optimizer.reload_model_params()

    depth = cfg.data.prefetch if cfg.data.prefetch is not None else (2 if rt.is_cuda else 0)
    family = get_model_family(m.name)
    prepare = functools.partial(family.prepare_host_batch, m=m) if family.prepare_host_batch else None
    batches = Prefetcher(loader, depth, prepare=prepare) if depth else loader
    try:
        return _loop(cfg, rt, model, ddp, optimizer, scheduler, batches, start, num_microbatches, dtype, mem,
                     last_good, lineage)
    finally:
        overlap = getattr(optimizer, "update_overlap", None)
        if overlap is not None:  # the last update may still run: callers read the parameters
            overlap.close()
        for graphs in _graphs_of(model):
            graphs.close()
        multi_tensor.stop_deferring()
        mem.close()
        if batches is not loader:
            batches.close()


def forward_step(cfg: Config, rt: Runtime, dtype: torch.dtype) -> ForwardStep:
    """The run's ForwardStep: how a micro-batch reaches the model (CP split, device copy, sparse LM
    head), fixed for the run once the process groups exist; training and evaluation share it."""
    m = cfg.model
    return ForwardStep(rt.device, dtype, cp_size=ps.get_context_parallel_world_size(),
                       cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group(),
                       image_token_id=m.vision_token_ids, cp_split_vision=cfg.parallel.cp_split_vision,
                       merge=m.vision.spatial_merge_size, sparse_lm_head=m.sparse_lm_head and m.fused_linear_ce,
                       row_extras=get_model_family(m.name).packed_row_extras)


def _loop(cfg, rt, model, ddp, optimizer, scheduler, batches, start, num_microbatches, dtype,
          mem: MemoryTools | None = None, last_good: str | None = None, lineage: dict | None = None) -> TrainResult:
    t, m, ck = cfg.train, cfg.model, cfg.checkpoint
    sink = MetricsSink(cfg.logging, rt.is_main, t.iters, start, cfg.to_dict())
    fwd_bwd = get_forward_backward_func()
    peak = device_peak_tflops(cfg.logging.peak_tflops)
    result = TrainResult(last_iteration=start)
    report = torch.zeros(4, device=rt.device)  # [loss_sum, tokens, MTP loss_sum, MTP tokens] since last log
    window = _Window()
    if rt.is_cuda:
        torch.cuda.reset_peak_memory_stats()

    profiler = StepProfiler(cfg.logging, dist.get_rank(), rt.is_cuda)
    pending: _PendingLog | None = None  # the last log step's numbers, still on the device
    clock = StepClock(rt.is_cuda)
    overlap = getattr(optimizer, "update_overlap", None)  # the step runs behind the next forward
    guard = NonFiniteGuard(optimizer, t.on_nonfinite, t.max_nonfinite_steps, rt.device)
    guard.last_good = last_good
    if last_good is not None:  # its loss / grad-norm history, and whether it was itself a good one
        guard.resume(checkpointing.trainer_state(Path(last_good)), last_good)
    use_async = ck.async_save if ck.async_save is not None else rt.is_cuda
    saves = AsyncSaves() if ck.dir and use_async else None
    stop = platform.StopSignals().install()  # SIGTERM / SIGINT: stop between steps, in one line
    began = time.perf_counter()
    step = forward_step(cfg, rt, dtype)  # the run's one, shared with the evaluation
    evaluator = Evaluator.build(cfg, rt, ddp, optimizer, step, num_microbatches)  # None: no validation

    def flush_log():
        nonlocal pending
        if pending is not None:  # cleared first: a failing emit must not be retried by the handler below
            p, pending = pending, None
            _emit(p, peak, sink, result, guard)

    def save_checkpoint(it: int) -> None:
        if overlap is not None:
            overlap.finish()  # the saved parameters and moments are this step's
        # every logged step up to this one is in metrics.jsonl before the checkpoint
        # exists: a resume from it drops later rows only, and none is lost
        flush_log()
        guard.before_save(it)
        if not weights_finite(model):
            raise NonFiniteError(f"step {it}: the weights are not finite, so no checkpoint was written; "
                                 f"last good checkpoint: {guard.last_good or 'none'}; lower optimizer.lr "
                                 "and resume from it")
        health = guard.checkpoint_state()
        saved = checkpointing.save(ck.dir, it, model, optimizer, scheduler, batches.state_dict(),
                                   ck.keep_last, meta_files=checkpoint_meta(cfg), saves=saves,
                                   extra={**(lineage or {}), **health})
        guard.saved(str(saved), health)
        result.checkpoint = str(saved)

    try:
        for it in range(start + 1, t.iters + 1):
            if saves is not None:
                saves.poll()  # a save whose files are written becomes `latest` now
            if stop.signal is not None:
                if saves is not None:
                    saves.wait()  # the checkpoint being written is completed first
                    if saves.deferred is not None and it - 1 > start:  # and a deferred one is made now
                        saves.deferred = None
                        save_checkpoint(it - 1)
                        saves.wait()
                raise stop.error(it - 1, _latest(ck), cfg)
            profiler.begin(it)
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            step.batches = []  # this step's micro-batches alone feed its FLOP and token counts
            outputs = fwd_bwd(
                forward_step_func=step,
                data_iterator=batches,
                model=[ddp],
                num_microbatches=num_microbatches,
                seq_length=t.seq_length,
                micro_batch_size=t.micro_batch_size,
                forward_only=False,
            )
            _, grad_norm, _ = optimizer.step()
            step_report = torch.zeros_like(report)
            for out in outputs:  # (none on pipeline stages without the loss)
                step_report[:2] += out["lm loss"]
                if "mtp loss" in out:  # model.mtp_num_layers
                    step_report[2:] += out["mtp loss"]
            # a skipped step (non-finite gradient norm) is counted, its loss left out of the window's
            report += guard.after_step(it, scheduler.get_lr(optimizer.param_groups[0]), step_report)
            scheduler.step(increment=1)
            if saves is not None and it == start + 2:  # the moments exist (an overlapped update included)
                saves.reserve_staging(model, optimizer)
            window.add(step.batches, m)
            result.tokens += sum(b["num_real_tokens"] for b in step.batches)
            profiler.end(it)
            sink.advance()
            if mem is not None:
                mem.after_step(it)

            # the previous log step's numbers are read only now, with this whole step queued
            # behind them: reading them at their own step would drain the GPU, and the next
            # step would start on an idle device while the host prepares its batch
            flush_log()
            evaluating = evaluator is not None and evaluator.due(it)  # a step that evaluates is logged
            if it % cfg.logging.interval == 0 or it == t.iters or evaluating:
                pending = _start_log(it, report, grad_norm, scheduler, window, clock, model, rt,
                                     t.global_batch_size * t.seq_length, overlap, guard.counters)
                pending.host.update(_data_counts(batches))
                report.zero_()  # (queued after the copies _start_log made of it)
                window = _Window()
            if evaluating:  # its val_* metrics go into this step's log row
                pending.host.update(evaluator.run(it))
                clock.mark()  # the evaluation's time stays out of the next log window's step time
            due = ck.dir and ((ck.interval and it % ck.interval == 0) or (it == t.iters and ck.save_at_end))
            if saves is not None:  # a save due while the previous one is still writing waits for a later step
                due = saves.due(it, bool(due), final=it == t.iters)
            if due:
                save_checkpoint(it)
            result.last_iteration = it
        flush_log()
        _log_data_summary(batches)
    except KeyboardInterrupt as e:  # Ctrl-C inside a step: the same one line as between steps
        raise platform.StopSignals.interrupted(result.last_iteration, _latest(ck), cfg) from e
    except BaseException as e:
        # keep the last log line of a run that fails one step later; with several ranks its
        # reductions may wait on a peer that is gone, so only alone
        if pending is not None and dist.get_world_size() == 1:
            it_pending = pending.it
            try:
                flush_log()
            except Exception as emit_error:  # noqa: BLE001 - the original error matters more
                log.warning("could not write the metrics of step %d (%s)", it_pending, emit_error)
        if isinstance(e, torch.OutOfMemoryError) and not isinstance(e, oom_advice.TrainingOutOfMemory):
            raise oom_advice.TrainingOutOfMemory(
                oom_advice.advice(cfg, result.last_iteration + 1, ps.get_data_parallel_world_size())) from e
        raise
    finally:
        profiler.close()  # a run that stops inside the window still writes its profile
        if saves is not None:
            saves.close()  # the save in flight is completed (or reported) before the run ends
        stop.uninstall()
    sink.close()
    if ck.save_hf and _latest(ck):
        _save_hf(cfg, Path(_latest(ck)), rt)
    if rt.is_main:
        log.info(_summary(cfg, result, start, time.perf_counter() - began, ps.get_data_parallel_world_size()))
    return result


def _save_hf(cfg: Config, ckpt: Path, rt: Runtime) -> None:
    """checkpoint.save_hf: the final checkpoint as a Hugging Face folder, shards shared among the ranks."""
    stats = hf_convert.save_hf_from_run(ckpt, cfg.checkpoint.save_hf, cfg.model, get_model_family(cfg.model.name),
                                        dist.get_rank(), dist.get_world_size())
    if rt.is_main:
        log.info("saved %s as Hugging Face weights in %s (%d tensors, %d shard(s), %.2f GB)%s", ckpt.name,
                 cfg.checkpoint.save_hf, stats["tensors"], stats["shards"], stats["bytes"] / 1e9,
                 f"; the untrained MTP head copied from {cfg.model.hf_config}" if stats["carried"] else "")


def _latest(ck) -> str | None:
    """The checkpoint ``latest`` names now, or None."""
    marker = Path(ck.dir) / "latest" if ck.dir else None
    return str(marker.parent / marker.read_text().strip()) if marker is not None and marker.is_file() else None


def _summary(cfg, result: TrainResult, start: int, seconds: float, dp_size: int) -> str:
    """The run's last line: what it did and where everything is."""
    losses = [(k, v) for k, v in sorted(result.losses.items()) if v == v]
    loss = f"final loss {losses[-1][1]:.4f} (step {losses[-1][0]})" if losses else "no finite loss logged"
    ck = cfg.checkpoint
    where = f"metrics: {Path(cfg.logging.dir) / 'metrics.jsonl'}"
    latest = _latest(ck)
    if latest:
        where += (f"; checkpoint: {latest} (continue: checkpoint.load=latest train.iters=N; export: python "
                  f"scripts/convert_hf.py export --ckpt {ck.dir} --out DIR)")
    else:
        where += "; no checkpoint (checkpoint.dir is null or no save was due)"
    return (f"done: steps {start + 1}-{result.last_iteration} in {seconds:.1f} s, {loss}, about "
            f"{result.tokens * dp_size:,} real tokens; {where}")


class _Window:
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
            self.flops += training_flops(model_cfg, b["sample_lengths"], grids, b.get("lm_head_tokens"))


@dataclass
class _PendingLog:
    """A log step's metrics, read later by ``_emit``: ``values`` is a host buffer that a
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


def _start_log(it, report, grad_norm, scheduler, window: _Window, clock: StepClock, model, rt: Runtime,
               processed_per_step: int, overlap=None, guard_counters=None) -> _PendingLog:
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
    if _graphs_of(model):  # micro-batches that ran eager layers instead (logged once per reason)
        host["cuda_graph_eager_batches"] = sum(sum(g.eager_batches.values()) for g in _graphs_of(model))
        host["cuda_graph_captures"] = sum(g.captures for g in _graphs_of(model))
        host["cuda_graph_capture_s"] = round(sum(g.capture_s for g in _graphs_of(model)), 3)
    on_device = torch.is_tensor(grad_norm)
    # with the update overlapped, the parameters are final only on its stream: the norm and the
    # copy queue there, so the compute stream does not wait for the whole update
    with overlap.behind_update(totals, grad_norm) if overlap is not None else nullcontext():
        param_norm = _param_norm(model)  # of this step's parameters, before the next step changes them
        g = grad_norm.reshape(1).to(totals) if on_device else totals.new_zeros(1)
        extra = [guard_counters.to(totals)] if guard_counters is not None else []  # nonfinite.COUNTERS
        values = torch.cat([totals[:4], param_norm.reshape(1).to(totals), g, *extra, totals[4:]])
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
    return _PendingLog(it, staged, host_grad, host, clock.mark(), clock, ready)


def _emit(p: _PendingLog, peak, sink: MetricsSink, result: TrainResult, guard: NonFiniteGuard | None = None) -> None:
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
        "mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if p.clock.is_cuda else _cpu_peak_gib(),
        "step_time_s": elapsed / max(p.host["steps"], 1),
        "supervised_tokens": int(totals[1]),
        "param_norm": totals[4],
        # real tokens / tokens processed (padding included): how full the packed rows were
        "real_token_fraction": totals[2] / max(p.host["processed_tokens"], 1),
    }
    if totals[-1] > 0:  # model.mtp_num_layers: the mean MTP loss over its shifted supervised tokens
        metrics["mtp_loss"] = totals[-2] / totals[-1]
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


def _data_counts(batches) -> dict:
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


def _log_data_summary(batches) -> None:
    counts = _data_counts(batches)
    if counts:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(counts.get("rows_skipped_by_reason", {}).items()))
        log.info("data: %d rows read, %d skipped%s (data-parallel rank %d)", counts["rows_read"],
                 counts["rows_skipped"], f" ({reasons})" if reasons else "", ps.get_data_parallel_rank())


def _param_norm(model) -> torch.Tensor:
    """L2 norm of all parameters, each counted once across tensor-parallel ranks and pipeline
    stages (the tied output weight copy on the last stage is marked shared), as a device scalar
    (log steps only). One multi-tensor norm per dtype group: a per-parameter float/square/sum cost
    three kernels and an fp32 copy of every parameter."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    device = next(model.parameters()).device
    dense, expert = [], []  # expert weights (allreduce=False) are split over EP, not replicated
    for p in model.parameters():
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


def _cpu_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
