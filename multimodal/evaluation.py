"""Validation loss: ``train.eval_interval`` steps apart and after the last step.

    evaluator = Evaluator.build(trainer)  # None when off; reads the Trainer's state
    if evaluator is not None and evaluator.due(it):
        metrics = evaluator.run(it)   # {"val_loss": ..., "val_tokens": ..., "val_time_s": ...}

What one evaluation does:
- Data: ``train.eval_iters`` global batches of the validation set (``valid_data_config``: the same
  kind of data set as training, held out), read by a fresh loader from the set's start every time,
  so every evaluation scores the same samples and the numbers compare. Data-parallel ranks shard
  the samples and pack their rows as training does; the training loader is never touched. Each
  sample counts at most once per evaluation: a set smaller than the rows fills them once, and the
  rows after its end are blank (no supervised token; ``one_pass`` in data/loader.py).
- Forward only: megatron's forward_backward_func with ``forward_only=True`` (any pipeline layout),
  under ``torch.no_grad`` with the model in eval mode, the modules' own modes restored afterwards.
  The micro-batches go through training's own ``ForwardStep`` (the run has one), so the two cannot
  differ in how a batch reaches the model; the host stats it records here are taken back out.
- Loss: the training loss's definition: per micro-batch the sum of masked token losses and the
  token count (multimodal/loss.py), summed over micro-batches on the device, broadcast from the last
  pipeline stage, summed over context- and data-parallel ranks; val_loss = sum / tokens, i.e. the
  mean over every supervised token evaluated. One host read per evaluation, none per micro-batch.
- Training is unchanged by it (tested bit for bit on the CPU): the RNG states (Python, numpy,
  torch, CUDA, megatron's tracker) are saved before and restored after; the optimizer step that may
  still run behind the forward (optimizer.overlap_step) is finished first, as before a checkpoint;
  no gradient is computed, so no gradient buffer changes. CUDA graphs (train.cuda_graphs): the
  decoder and vision routers refuse to replay outside training (no grad / eval mode) before they
  load anything into their static buffers, so evaluation runs the eager layers and the captured
  graphs and their buffers are left as they were; the eager micro-batches of evaluation are taken
  back out of the routers' cuda_graph_eager_batches counts, which report training steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from data.loader import MicroBatchIterator
from data.registry import build_dataset
from multimodal import checkpointing
from multimodal.context_parallel import sequence_pad_multiple
from multimodal.forward_step import chunk_iterators, schedule_seq_length
from multimodal.transforms import graphs_of

log = logging.getLogger(__name__)


def valid_data_config(data_cfg):
    """The data section the validation set is built from: the training data's, with the held-out
    source (see DataConfig.valid_path)."""
    d = data_cfg
    if d.name == "conversations":
        return dataclasses.replace(d, path=d.valid_path)
    if d.name == "cord_v2":
        return dataclasses.replace(d, path=d.valid_path or d.path, split=d.valid_split)
    if d.name == "energon":  # the prepared folder's held-out split (energon prepare's val part)
        return dataclasses.replace(d, path=d.valid_path or d.path,
                                   energon=dataclasses.replace(d.energon, split_part="val"))
    if d.name == "mock":  # samples are functions of (seed, index): another seed, other samples
        return dataclasses.replace(d, seed=d.seed + 1)
    raise ValueError(f"no validation data for data.name={d.name!r}")


class Evaluator:
    def __init__(self, trainer, dataset):
        """``trainer``: the run's Trainer (multimodal/trainer.py), read for its config, runtime, DDP
        chunks, optimizer, ForwardStep and micro-batch count; ``dataset``: the validation set."""
        self.trainer = trainer
        self.cfg, self.rt, self.step = trainer.cfg, trainer.rt, trainer.step
        self.dataset = dataset
        t = self.cfg.train
        self.interval, self.iters, self.last = t.eval_interval, t.eval_iters, t.iters
        self.fwd = get_forward_backward_func()
        self._told_blank = False

    @classmethod
    def build(cls, trainer) -> Evaluator | None:
        """None when ``train.eval_interval`` is 0. The validation set is opened here, at start-up,
        so a missing file stops the run before the first step, not at the first evaluation."""
        cfg = trainer.cfg
        if not cfg.train.eval_interval:
            return None
        dataset = build_dataset(cfg.model, valid_data_config(cfg.data), cfg.train.seq_length)
        log.info("validation: %d samples, %d global batch(es) (%d rows) every %d steps and after the last",
                 len(dataset), cfg.train.eval_iters, cfg.train.eval_iters * cfg.train.global_batch_size,
                 cfg.train.eval_interval)
        return cls(trainer, dataset)

    def due(self, it: int) -> bool:
        return it % self.interval == 0 or it == self.last

    def _loader(self) -> MicroBatchIterator:
        """A fresh pass from the validation set's start (rank r reads samples r, r + DP, ...)."""
        cfg = self.cfg
        return MicroBatchIterator.from_config(
            self.dataset, cfg.model, cfg.data, cfg.train, ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(), pad_multiple=sequence_pad_multiple(cfg), one_pass=True)

    def run(self, it: int) -> dict:
        """One evaluation with the current weights -> {val_loss, val_tokens, val_time_s} (every rank)."""
        start = time.perf_counter()
        trainer = self.trainer
        if trainer.overlap is not None:
            trainer.overlap.finish()  # the parameters are this step's
        rng = checkpointing._rng_state()
        routers = graphs_of(trainer.chunks)
        eager_counts = [Counter(g.eager_batches) for g in routers]
        modes = [(module, module.training) for ddp in trainer.ddp for module in ddp.modules()]
        loader = self._loader()
        rows = chunk_iterators(loader, len(trainer.ddp))  # every model chunk reads each micro-batch
        report = torch.zeros(2, device=self.rt.device)  # [loss_sum, tokens], as training's
        counted = len(self.step.batches)  # training's FLOP and token counts never see evaluation's rows
        for ddp in trainer.ddp:
            ddp.eval()
        try:
            with torch.no_grad():
                for _ in range(self.iters):
                    outputs = self.fwd(forward_step_func=self.step, data_iterator=rows, model=trainer.ddp,
                                       num_microbatches=trainer.num_microbatches,
                                       seq_length=schedule_seq_length(trainer.ddp, self.cfg.train.seq_length),
                                       micro_batch_size=self.cfg.train.micro_batch_size, forward_only=True)
                    for out in outputs:  # (none on pipeline stages without the loss)
                        report += out["lm loss"]
        finally:
            for module, training in modes:
                module.training = training
            for g, before in zip(routers, eager_counts):
                # keep the reasons (a reason already seen is not warned about again), not the counts
                for reason in g.eager_batches:
                    g.eager_batches[reason] = before.get(reason, 0)
            checkpointing._set_rng_state(rng)
            del self.step.batches[counted:]
        self._tell_blank(loader)
        # the reductions of training's loss (step_metrics.start_log): last pipeline stage -> all
        # stages, then the sum over context-parallel and data-parallel ranks
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(report, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if ps.get_context_parallel_world_size() > 1:
            dist.all_reduce(report, group=ps.get_context_parallel_group())
        totals = report.double()
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
        loss_sum, tokens = totals.tolist()  # the one host read of the evaluation
        loss = loss_sum / tokens if tokens > 0 else float("nan")
        return {"val_loss": loss, "val_tokens": int(tokens), "val_time_s": time.perf_counter() - start}

    def _tell_blank(self, loader: MicroBatchIterator) -> None:
        """Say (once) when the validation set ran out before train.eval_iters' rows did: those rows
        were blank, computed and scored on nothing."""
        if loader.blank_rows and not self._told_blank:
            self._told_blank = True
            log.warning("validation: the %d samples of the validation set end before train.eval_iters=%d global "
                        "batch(es); %d row(s) on this rank were blank (each sample counts once, none repeats); "
                        "they cost compute and score nothing: add samples or lower train.eval_iters",
                        len(self.dataset), self.iters, loader.blank_rows)
