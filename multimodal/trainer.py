"""The Trainer: the state of one run and the loop over it.

    trainer = Trainer(cfg, rt)      # after the process groups exist (training.train sets them up)
    result = trainer.run()          # build, load, loop, close

State, built in this order by ``run``: the model chunks (one per virtual pipeline stage) passed
through the ordered transforms of multimodal/transforms.py (DDP wrappers among them), the optimizer
and its scheduler, the loader and the batches it feeds, the checkpoint it resumes from; then the
loop's own: the ForwardStep shared by training and evaluation, the metrics sink, the step clock,
the non-finite guard, the asynchronous saver and the evaluator. One step = ``num_microbatches``
micro-batches through megatron's forward_backward_func, then one optimizer step; loss, token
counts and timings stay on the device and are read back one log step late (step_metrics).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from core.errors import NonFiniteError
from core.seeding import seed_everything
from data.loader import MicroBatchIterator, build_dataset, default_num_workers
from data.prefetch import Prefetcher
from models import get_hf_adapter, get_model_builder, get_model_family
from models.common.virtual_pipeline import as_one_module, build_model_chunks
from models.performance import layer_graphs
from multimodal import checkpointing, grad_scaling, hf_convert, platform, step_metrics, transforms
from multimodal.async_saves import AsyncSaves
from multimodal.config import Config
from multimodal.context_parallel import sequence_pad_multiple
from multimodal.evaluation import Evaluator
from multimodal.flops import device_peak_tflops
from multimodal.forward_step import ForwardStep, chunk_iterators, schedule_seq_length
from multimodal.nonfinite import NonFiniteGuard, weights_finite
from multimodal.observability import oom_advice
from multimodal.observability.memory import MemoryTools
from multimodal.observability.metrics import MetricsSink
from multimodal.observability.profiling import StepProfiler
from multimodal.observability.step_clock import StepClock
from multimodal.optimizer import build_optimizer
from multimodal.performance import multi_tensor
from multimodal.platform import Runtime, use_deterministic_algorithms

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


def build_model(cfg: Config, rt: Runtime, dtype: torch.dtype, planned=None):
    """(ModelBuild, optimizer, scheduler): the model chunks built for this pipeline stage, passed
    through the transforms (``planned``, default: ``transforms.plan``), then the optimizer over them
    and megatron's gradient hooks, the scaling contract checked."""
    planned = transforms.plan(cfg, rt) if planned is None else planned
    # Pipeline stages: the first embeds (vision encoder + token embedding), the last owns the
    # output layer and the loss; each chunk (virtual stage) builds only its own decoder layers.
    chunks = build_model_chunks(get_model_builder(cfg.model.name), cfg.model, cfg.parallel, dtype,
                                deterministic=cfg.train.deterministic)
    built = transforms.apply_all(transforms.ModelBuild(cfg, rt, [c.to(rt.device) for c in chunks]), planned)
    if len(built.ddp) != len(built.chunks):
        raise RuntimeError("model transforms: no DDP wrapper per model chunk; keep transforms.DDPWrap in the list")
    optimizer, scheduler = build_optimizer(cfg, built.chunks, built.ddp, dtype)
    grad_scaling.install(built.chunks, built.ddp, optimizer)
    return built, optimizer, scheduler


def forward_step(cfg: Config, rt: Runtime, dtype: torch.dtype) -> ForwardStep:
    """The run's ForwardStep: how a micro-batch reaches the model (CP split, device copy, sparse LM
    head), fixed for the run once the process groups exist; training and evaluation share it."""
    m = cfg.model
    return ForwardStep(rt.device, dtype, cp_size=ps.get_context_parallel_world_size(),
                       cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group(),
                       image_token_id=m.vision_token_ids, cp_split_vision=cfg.parallel.cp_split_vision,
                       merge=m.vision.spatial_merge_size, sparse_lm_head=m.sparse_lm_head and m.fused_linear_ce,
                       row_extras=get_model_family(m.name).packed_row_extras)


def checkpoint_meta(cfg: Config) -> dict[str, str]:
    """Architecture files stored in every checkpoint (export reads them)."""
    meta = {"model_config.json": json.dumps(dataclasses.asdict(cfg.model), indent=1)}
    if cfg.model.hf_config:
        p = Path(cfg.model.hf_config)
        meta["hf_config.json"] = (p if p.is_file() else p / "config.json").read_text()
    return meta


def latest_checkpoint(ck) -> str | None:
    """The checkpoint ``latest`` names now, or None."""
    marker = Path(ck.dir) / "latest" if ck.dir else None
    return str(marker.parent / marker.read_text().strip()) if marker is not None and marker.is_file() else None


class Trainer:
    """One run's state and its loop; ``hf_plan``: where a Hugging Face folder's tensors go
    (hf_convert.reference_plan, worked out before the run's parallel layout existed)."""

    def __init__(self, cfg: Config, rt: Runtime, hf_plan=None):
        self.cfg, self.rt, self.hf_plan = cfg, rt, hf_plan
        self.dtype = resolve_dtype(cfg.train.precision, rt)
        self.transforms = transforms.plan(cfg, rt)  # the order checked before anything is built
        self.chunks: list[torch.nn.Module] = []  # one per virtual pipeline stage
        self.ddp: list = []                      # their DDP wrappers, in the same order
        self.optimizer = self.scheduler = None
        self.loader: MicroBatchIterator | None = None
        self.batches = None                      # the loader, or the prefetch thread over it
        self.num_microbatches = 0
        self.start, self.last_good, self.lineage = 0, None, None
        self.result = TrainResult()
        self.mem: MemoryTools | None = None

    @property
    def overlap(self):
        """The optimizer update running behind the next forward (optimizer.overlap_step), or None."""
        return getattr(self.optimizer, "update_overlap", None)

    # ------------------------------------------------------------------ the run

    def run(self) -> TrainResult:
        t = self.cfg.train
        seed_everything(t.seed)
        use_deterministic_algorithms(t.deterministic)
        # before the model is built, so the allocator history shows parameters and optimizer state too
        self.mem = MemoryTools(self.cfg.logging, self.rt.is_cuda, dist.get_rank()).start()
        previous_stream = None
        if t.cuda_graphs.enabled and self.rt.is_cuda:
            previous_stream = layer_graphs.use_side_stream()  # before DDP creates its gradient accumulator nodes
        try:
            load_path = self._prepare_checkpoint_dir()
            self._build()
            try:
                self._open_loader()
                self._load(load_path)
                self._start_batches()  # after the load: a prefetch thread reads ahead from the restored position
                return self._loop()
            finally:
                self._close()
        finally:
            self.mem.close()
            if previous_stream is not None:
                torch.cuda.current_stream().synchronize()
                torch.cuda.set_stream(previous_stream)

    def _prepare_checkpoint_dir(self):
        """The checkpoint to resume from, resolved before anything is built: a mistyped
        checkpoint.load stops here, in a second (a Hugging Face folder is read by ``hf_plan``)."""
        ck = self.cfg.checkpoint
        load_path = checkpointing.resolve(ck.load, ck.dir) if ck.load and self.hf_plan is None else None
        if ck.dir:  # a folder that cannot take this run's checkpoints stops it now, not at the first save
            checkpointing.check_writable(ck.dir)
            self.lineage = checkpointing.start_run(ck.dir, load_path, ck.overwrite)
        return load_path

    def _build(self) -> None:
        cfg, rt = self.cfg, self.rt
        built, self.optimizer, self.scheduler = build_model(cfg, rt, self.dtype, self.transforms)
        self.chunks, self.ddp = built.chunks, built.ddp
        if cfg.checkpoint.dir:
            checkpointing.check_free_space(cfg.checkpoint.dir,
                                           *checkpointing.estimate_bytes(self.chunks, rt.world_size))
        t, dp_size = cfg.train, ps.get_data_parallel_world_size()
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * dp_size)
        if rt.is_main:
            n_params = sum(q.numel() for c in self.chunks for q in c.parameters())
            log.info("model %s: %.2fM parameters per rank, dtype %s, device %s, dp=%d, pp=%d, micro-batches/step=%d",
                     cfg.model.name, n_params / 1e6, self.dtype, rt.device, dp_size, cfg.parallel.pp,
                     self.num_microbatches)

    def _open_loader(self) -> None:
        cfg, m, loader_cfg = self.cfg, self.cfg.model, self.cfg.data.loader
        if loader_cfg.num_workers is None:  # resolved here, so the saved config says what ran
            loader_cfg.num_workers = default_num_workers(self.rt.is_cuda)
            log.info("data: %d decode worker process(es) per rank (data.loader.num_workers)", loader_cfg.num_workers)
        dataset = build_dataset(m, cfg.data, cfg.train.seq_length)
        self.loader = MicroBatchIterator.from_config(dataset, m, cfg.data, cfg.train, ps.get_data_parallel_rank(),
                                                     ps.get_data_parallel_world_size(),
                                                     pad_multiple=sequence_pad_multiple(cfg))

    def _start_batches(self) -> None:
        """The batches the schedule reads: the loader, or a thread that builds them ahead of it."""
        m, loader_cfg = self.cfg.model, self.cfg.data.loader
        depth = loader_cfg.prefetch if loader_cfg.prefetch is not None else (2 if self.rt.is_cuda else 0)
        family = get_model_family(m.name)
        prepare = functools.partial(family.prepare_host_batch, m=m) if family.prepare_host_batch else None
        self.batches = Prefetcher(self.loader, depth, prepare=prepare) if depth else self.loader
        self.data_iterator = chunk_iterators(self.batches, len(self.chunks))  # what the schedule reads

    def _load(self, load_path) -> None:
        """Weights from a Hugging Face folder, or the whole state from one of our checkpoints."""
        cfg, m = self.cfg, self.cfg.model
        if self.hf_plan is not None:
            counts = {"tensors": 0, "bytes": 0}
            for chunk in self.chunks:  # each chunk (virtual stage) reads the tensors of its own layers
                got = hf_convert.load_hf_weights(chunk, cfg.checkpoint.load, m,
                                                 get_hf_adapter(get_model_family(m.name)), self.hf_plan)
                counts = {k: counts[k] + got[k] for k in counts}
            log.info("loaded %d tensors (%.2f GB on this rank) straight from the Hugging Face folder %s; optimizer "
                     "and step start fresh", counts["tensors"], counts["bytes"] / 1e9, cfg.checkpoint.load)
        if load_path is not None:
            self.start, data_state = checkpointing.load(load_path, self.chunks, self.optimizer, self.scheduler,
                                                        model_config=dataclasses.asdict(m), trust=cfg.checkpoint.trust)
            self.last_good = str(load_path)
            if data_state is not None:
                self.loader.load_state_dict(data_state)
        if (self.start == 0 and (self.hf_plan is not None or load_path is not None)
                and hasattr(self.optimizer, "reload_model_params")):
            # weights loaded after the optimizer was built: its fp32 main copies (bf16 training) are
            # still the initial weights until they are copied again
            self.optimizer.reload_model_params()
        self.result.last_iteration = self.start

    def _close(self) -> None:
        """Release what the build and the data opened (the memory tools are closed by ``run``)."""
        if self.overlap is not None:  # the last update may still run: callers read the parameters
            self.overlap.close()
        for graphs in transforms.graphs_of(self.chunks):
            graphs.close()
        multi_tensor.stop_deferring()
        if self.batches is not None and self.batches is not self.loader:
            self.batches.close()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> TrainResult:
        cfg, rt, t, ck = self.cfg, self.rt, self.cfg.train, self.cfg.checkpoint
        self.sink = MetricsSink(cfg.logging, rt.is_main, t.iters, self.start, cfg.to_dict())
        self.fwd_bwd = get_forward_backward_func()
        self.peak = device_peak_tflops(cfg.logging.peak_tflops)
        self.report = torch.zeros(4, device=rt.device)  # [loss_sum, tokens, MTP loss_sum, MTP tokens] since last log
        self.window = step_metrics.Window()
        if rt.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        self.profiler = StepProfiler(cfg.logging, dist.get_rank(), rt.is_cuda)
        self.pending: step_metrics.PendingLog | None = None  # the last log step's numbers, still on the device
        self.clock = StepClock(rt.is_cuda)
        self.guard = NonFiniteGuard(self.optimizer, t.on_nonfinite, t.max_nonfinite_steps, rt.device)
        self.guard.last_good = self.last_good
        if self.last_good is not None:  # its loss / grad-norm history, and whether it was itself a good one
            self.guard.resume(checkpointing.trainer_state(Path(self.last_good)), self.last_good)
        use_async = ck.async_save if ck.async_save is not None else rt.is_cuda
        self.saves = AsyncSaves() if ck.dir and use_async else None
        self.stop = platform.StopSignals().install()  # SIGTERM / SIGINT: stop between steps, in one line
        began = time.perf_counter()
        self.step = forward_step(cfg, rt, self.dtype)  # the run's one, shared with the evaluation
        self.evaluator = Evaluator.build(self)  # None: no validation
        try:
            for it in range(self.start + 1, t.iters + 1):
                self._stop_if_signalled(it)
                grad_norm = self.train_step(it)
                self._after_step(it, grad_norm)
                self.result.last_iteration = it
            self.flush_log()
            step_metrics.log_data_summary(self.batches)
        except KeyboardInterrupt as e:  # Ctrl-C inside a step: the same one line as between steps
            raise platform.StopSignals.interrupted(self.result.last_iteration, latest_checkpoint(ck), cfg) from e
        except BaseException as e:
            self._flush_after_failure()
            if isinstance(e, torch.OutOfMemoryError) and not isinstance(e, oom_advice.TrainingOutOfMemory):
                raise oom_advice.TrainingOutOfMemory(
                    oom_advice.advice(cfg, self.result.last_iteration + 1, ps.get_data_parallel_world_size())) from e
            raise
        finally:
            self.profiler.close()  # a run that stops inside the window still writes its profile
            if self.saves is not None:
                self.saves.close()  # the save in flight is completed (or reported) before the run ends
            self.stop.uninstall()
        self.sink.close()
        if ck.save_hf and latest_checkpoint(ck):
            self._save_hf(Path(latest_checkpoint(ck)))
        if rt.is_main:
            log.info(_summary(cfg, self.result, self.start, time.perf_counter() - began,
                              ps.get_data_parallel_world_size()))
        return self.result

    def train_step(self, it: int):
        """One optimizer step over ``num_microbatches`` micro-batches; returns the gradient norm
        (a device tensor, a float, or None, as the optimizer gives it)."""
        t = self.cfg.train
        self.profiler.begin(it)
        for ddp in self.ddp:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.step.batches = []  # this step's micro-batches alone feed its FLOP and token counts
        outputs = self.fwd_bwd(forward_step_func=self.step, data_iterator=self.data_iterator, model=self.ddp,
                               num_microbatches=self.num_microbatches,
                               seq_length=schedule_seq_length(self.ddp, t.seq_length),
                               micro_batch_size=t.micro_batch_size, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        step_report = torch.zeros_like(self.report)
        for out in outputs:  # (none on pipeline stages without the loss)
            step_report[:2] += out["lm loss"]
            if "mtp loss" in out:  # model.mtp_num_layers
                step_report[2:] += out["mtp loss"]
        # a skipped step (non-finite gradient norm) is counted, its loss left out of the window's
        self.report += self.guard.after_step(it, self.scheduler.get_lr(self.optimizer.param_groups[0]), step_report)
        self.scheduler.step(increment=1)
        if self.saves is not None and it == self.start + 2:  # the moments exist (an overlapped update included)
            self.saves.reserve_staging(as_one_module(self.chunks), self.optimizer)
        self.window.add(self.step.batches, self.cfg.model)
        self.result.tokens += sum(b["num_real_tokens"] for b in self.step.batches)
        self.profiler.end(it)
        self.sink.advance()
        self.mem.after_step(it)
        return grad_norm

    def _after_step(self, it: int, grad_norm) -> None:
        """The log row, the evaluation and the checkpoint that fall due at step ``it``."""
        cfg, t, ck = self.cfg, self.cfg.train, self.cfg.checkpoint
        # the previous log step's numbers are read only now, with this whole step queued
        # behind them: reading them at their own step would drain the GPU, and the next
        # step would start on an idle device while the host prepares its batch
        self.flush_log()
        evaluating = self.evaluator is not None and self.evaluator.due(it)  # a step that evaluates is logged
        if it % cfg.logging.interval == 0 or it == t.iters or evaluating:
            self.pending = step_metrics.start_log(it, self.report, grad_norm, self.scheduler, self.window, self.clock,
                                                  self.chunks, self.rt, t.global_batch_size * t.seq_length,
                                                  self.overlap, self.guard.counters)
            self.pending.host.update(step_metrics.data_counts(self.batches))
            self.report.zero_()  # (queued after the copies start_log made of it)
            self.window = step_metrics.Window()
        if evaluating:  # its val_* metrics go into this step's log row
            self.pending.host.update(self.evaluator.run(it))
            self.clock.mark()  # the evaluation's time stays out of the next log window's step time
        due = ck.dir and ((ck.interval and it % ck.interval == 0) or (it == t.iters and ck.save_at_end))
        if self.saves is not None:  # a save due while the previous one is still writing waits for a later step
            due = self.saves.due(it, bool(due), final=it == t.iters)
        if due:
            self.save(it)

    def _stop_if_signalled(self, it: int) -> None:
        """Between steps: a finished save becomes ``latest``; SIGTERM / SIGINT stops the run in one line."""
        saves = self.saves
        if saves is not None:
            saves.poll()  # a save whose files are written becomes `latest` now
        if self.stop.signal is None:
            return
        if saves is not None:
            saves.wait()  # the checkpoint being written is completed first
            if saves.deferred is not None and it - 1 > self.start:  # and a deferred one is made now
                saves.deferred = None
                self.save(it - 1)
                saves.wait()
        raise self.stop.error(it - 1, latest_checkpoint(self.cfg.checkpoint), self.cfg)

    def flush_log(self) -> None:
        """Write the pending log row (its values read back now)."""
        if self.pending is not None:  # cleared first: a failing emit must not be retried by the handler below
            p, self.pending = self.pending, None
            step_metrics.emit(p, self.peak, self.sink, self.result, self.guard)

    def _flush_after_failure(self) -> None:
        """Keep the last log line of a run that fails one step later; with several ranks its
        reductions may wait on a peer that is gone, so only alone."""
        if self.pending is not None and dist.get_world_size() == 1:
            it_pending = self.pending.it
            try:
                self.flush_log()
            except Exception as emit_error:  # noqa: BLE001 - the original error matters more
                log.warning("could not write the metrics of step %d (%s)", it_pending, emit_error)

    def save(self, it: int) -> None:
        """A checkpoint of step ``it`` (asynchronous where the saver is), after its log rows."""
        if self.overlap is not None:
            self.overlap.finish()  # the saved parameters and moments are this step's
        # every logged step up to this one is in metrics.jsonl before the checkpoint
        # exists: a resume from it drops later rows only, and none is lost
        self.flush_log()
        self.guard.before_save(it)
        if not all(weights_finite(chunk) for chunk in self.chunks):
            raise NonFiniteError(f"step {it}: the weights are not finite, so no checkpoint was written; "
                                 f"last good checkpoint: {self.guard.last_good or 'none'}; lower optimizer.lr "
                                 "and resume from it")
        health = self.guard.checkpoint_state()
        ck = self.cfg.checkpoint
        saved = checkpointing.save(ck.dir, it, self.chunks, self.optimizer, self.scheduler,
                                   self.batches.state_dict(), ck.keep_last, meta_files=checkpoint_meta(self.cfg),
                                   saves=self.saves, extra={**(self.lineage or {}), **health})
        self.guard.saved(str(saved), health)
        self.result.checkpoint = str(saved)

    def _save_hf(self, ckpt: Path) -> None:
        """checkpoint.save_hf: the final checkpoint as a Hugging Face folder, shards shared among the ranks."""
        cfg = self.cfg
        stats = hf_convert.save_hf_from_run(ckpt, cfg.checkpoint.save_hf, cfg.model, get_model_family(cfg.model.name),
                                            dist.get_rank(), dist.get_world_size())
        if self.rt.is_main:
            log.info("saved %s as Hugging Face weights in %s (%d tensors, %d shard(s), %.2f GB)%s", ckpt.name,
                     cfg.checkpoint.save_hf, stats["tensors"], stats["shards"], stats["bytes"] / 1e9,
                     f"; the untrained MTP head copied from {cfg.model.hf_config}" if stats["carried"] else "")


def _summary(cfg, result: TrainResult, start: int, seconds: float, dp_size: int) -> str:
    """The run's last line: what it did and where everything is."""
    losses = [(k, v) for k, v in sorted(result.losses.items()) if v == v]
    loss = f"final loss {losses[-1][1]:.4f} (step {losses[-1][0]})" if losses else "no finite loss logged"
    ck = cfg.checkpoint
    where = f"metrics: {Path(cfg.logging.dir) / 'metrics.jsonl'}"
    latest = latest_checkpoint(ck)
    if latest:
        where += (f"; checkpoint: {latest} (continue: checkpoint.load=latest train.iters=N; export: python "
                  f"scripts/convert_hf.py export --ckpt {ck.dir} --out DIR)")
    else:
        where += "; no checkpoint (checkpoint.dir is null or no save was due)"
    return (f"done: steps {start + 1}-{result.last_iteration} in {seconds:.1f} s, {loss}, about "
            f"{result.tokens * dp_size:,} real tokens; {where}")
