"""What to change when a training step runs out of GPU memory.

A bare ``torch.OutOfMemoryError`` names the allocation that failed, not the knobs that would
make the run fit. The training loop re-raises it as ``TrainingOutOfMemory`` (still an
``OutOfMemoryError``, chained to the original) whose message lists this run's options, each
with the setting to change, in the order that costs least speed first.

The figures quoted in the messages are measured: docs/performance.md, the 2B row-length table.
"""

from __future__ import annotations

import torch

from multimodal.performance.recompute import sweep_choices


class TrainingOutOfMemory(torch.OutOfMemoryError):
    """A training step ran out of GPU memory; the message says what to change."""


def advice(cfg, step: int, data_parallel: int = 1) -> str:
    """The message for an out-of-memory error at ``step`` with config ``cfg`` on ``data_parallel``
    data-parallel ranks."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    where = f"step {step}, train.seq_length={t.seq_length}, train.micro_batch_size={t.micro_batch_size}"
    usage = _usage()
    lines = [f"out of GPU memory at {where}{usage}. Options, cheapest first:"]
    every = sorted({name for choice in sweep_choices(m) for name in choice})
    if p.cp > 1:  # GDN's recompute blocks are not implemented under context parallelism
        every = [name for name in every if not name.startswith("gdn_")]
    missing = [name for name in every if name not in t.recompute_modules]
    if missing:
        wanted = "[" + ",".join(sorted(set(t.recompute_modules) | set(missing))) + "]"
        graphs = " train.cuda_graphs=false (the graphs cannot replay recomputed blocks)" if t.cuda_graphs.enabled else ""
        lines.append(f"  - selective recompute: train.recompute_modules={wanted}{graphs}; it trades step time for "
                     "memory (what it saves and costs on the 2B recipe: docs/performance.md, selective recompute)")
    if t.global_batch_size > t.micro_batch_size and t.micro_batch_size > 1:
        lines.append("  - smaller micro-batches, more of them: lower train.micro_batch_size "
                     "(train.global_batch_size stays)")
    lines.append(f"  - context parallelism: parallel.cp={2 * p.cp} splits every row over {2 * p.cp} GPUs")
    if not p.use_distributed_optimizer:
        ranks = (f"over the {data_parallel} data-parallel ranks" if data_parallel > 1 else
                 "over data-parallel ranks (this run has one: it needs more GPUs)")
        lines.append(f"  - parallel.use_distributed_optimizer=true shards the fp32 parameters and Adam moments "
                     f"{ranks}: 12 bytes per parameter, divided by their number")
    lines.append(f"  - shorter rows: a lower train.seq_length (now {t.seq_length})")
    if getattr(t, "fp8", None):
        from models.common.fp8 import transient_bytes  # noqa: PLC0415

        extra = transient_bytes(m, t.micro_batch_size * t.seq_length / p.cp, p.tp) / 2**30
        lines.append(f"  - train.fp8={t.fp8} adds about {extra:.2f} GiB at the peak (each GEMM's fp8 casts of its "
                     "activation, gradient and weight; no weight copies are kept): train.fp8=null frees it, "
                     "or add the widest layers to train.fp8_exclude")
    lines.append("  Check a layout without a GPU first: python pretrain_multimodal.py --config CFG [key=value ...] "
                 "--dry-run --gpu-mem-gib GIB (its activation estimate assumes no recompute and runs high; "
                 "docs/performance.md compares it with measured peaks)")
    return "\n".join(lines)


def _usage() -> str:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    peak = torch.cuda.max_memory_allocated()
    return f" (peak allocated {peak / 2**30:.1f} of {total / 2**30:.1f} GiB)"
