"""Interleaved (virtual) pipeline training driven directly through megatron-core's schedule.

``train(out, config, layout, overrides)`` builds this rank's model chunks (models/common/
virtual_pipeline.py) for ``layout`` (``"tp=2,pp=2,vpp=2"`` style), gives them the layout-independent
init of train.seed, wraps each in megatron's DDP, builds megatron's optimizer over all of them (the
distributed one under ``parallel.use_distributed_optimizer``) with the recipe's warm-up/cosine
schedule, and trains ``train.iters`` steps with ``get_forward_backward_func()`` (the interleaved 1F1B
schedule when vpp > 1) on the run's loader, ForwardStep and gradient-scaling hooks, one data
iterator per chunk (``chunk_iterators``). ``save_at=K`` saves a dist checkpoint (model, optimizer,
scheduler, loader) after step K under ``out/ckpt``; ``load`` resumes from one first. Returns, per
step, [loss sum, tokens] where this rank holds the loss (the last pipeline stage) and the grad norm,
with the parameters and global layer numbers this rank holds.

Under torchrun: ``python -m torch.distributed.run --nproc-per-node N tests/helpers/mp_vpp.py RUNS.json``
runs each entry of the JSON list (keyword arguments of ``train``) in turn in the same processes and
writes ``<out>/rank_<r>.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def train(out: str, config: str, layout: str, overrides: list[str], save_at: int | None = None,
          load: str | None = None) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from core.seeding import seed_everything
    from data.loader import MicroBatchIterator
    from data.registry import build_dataset
    from models import get_model_family
    from models.common.layout_init import init_layout_independent
    from models.common.virtual_pipeline import build_model_chunks
    from multimodal import checkpointing, grad_scaling
    from multimodal.config import load_config, resolve_sources, validate
    from multimodal.context_parallel import sequence_pad_multiple
    from multimodal.forward_step import ForwardStep, chunk_iterators
    from multimodal.platform import init_distributed

    began, out = time.perf_counter(), Path(out)
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}
    cfg = resolve_sources(load_config(config, [*overrides, *(f"parallel.{k}={v}" for k, v in sizes.items())]))
    rt = init_distributed()
    if ps.model_parallel_is_initialized():  # in-process under the tests' one-rank state
        ps.destroy_model_parallel()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    validate(cfg, rt.world_size)
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                 virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None)
    seed_everything(t.seed)
    family = get_model_family(m.name)
    chunks = build_model_chunks(family.build, m, p, torch.float32, deterministic=t.deterministic)
    for chunk in chunks:
        init_layout_independent(chunk, t.seed)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, average_in_collective=False,
                                               use_distributed_optimizer=p.use_distributed_optimizer)
    # megatron-LM's choice for chunks after the first: one bucket each, reduced when the chunk's backward ends
    ddp = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
           for i, c in enumerate(chunks)]
    o = cfg.optimizer
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, params_dtype=torch.float32,
        use_distributed_optimizer=p.use_distributed_optimizer), ddp)
    # the recipe's warm-up then cosine decay over train.iters, as multimodal/optimizer.py sets it up
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
                                        lr_warmup_steps=o.warmup_iters, lr_decay_steps=t.iters,
                                        lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay,
                                        wd_incr_steps=t.iters, wd_incr_style="constant")
    grad_scaling.install(chunks, ddp, optimizer)

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    num_microbatches = t.global_batch_size // (t.micro_batch_size * dp_size)
    loader = MicroBatchIterator.from_config(build_dataset(m, cfg.data, t.seq_length), m, cfg.data, t, dp_rank,
                                            dp_size, pad_multiple=sequence_pad_multiple(cfg))
    start = 0
    if load is not None:
        start, data_state = checkpointing.load(Path(load), chunks, optimizer, scheduler)
        loader.load_state_dict(data_state)
    step = ForwardStep(rt.device, torch.float32, image_token_id=m.vision_token_ids,
                       merge=m.vision.spatial_merge_size, row_extras=family.packed_row_extras)
    iterators = chunk_iterators(loader, len(chunks))
    fwd_bwd = get_forward_backward_func()
    record = {"schedule": fwd_bwd.__name__, "steps": {}, "batches": {},
              "params": sum(q.numel() for c in chunks for q in c.parameters()),
              "layers": [[layer.layer_number for layer in c.language_model.decoder.layers] for c in chunks]}
    for it in range(start + 1, t.iters + 1):
        for d in ddp:
            d.zero_grad_buffer()
        optimizer.zero_grad()
        step.batches = []
        outputs = fwd_bwd(forward_step_func=step, data_iterator=iterators, model=ddp,
                          num_microbatches=num_microbatches, seq_length=t.seq_length,
                          micro_batch_size=t.micro_batch_size, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        report = sum((o_["lm loss"] for o_ in outputs), torch.zeros(2))
        record["steps"][str(it)] = {"loss": report.tolist() if outputs else None, "grad_norm": float(grad_norm)}
        record["batches"][str(it)] = len(step.batches)
        if save_at == it:
            checkpointing.save(str(out / "ckpt"), it, chunks, optimizer, scheduler, loader.state_dict())
    record["seconds"] = time.perf_counter() - began
    ps.destroy_model_parallel()
    return record


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch.distributed as dist

    for run in json.loads(Path(sys.argv[1]).read_text()):
        result = train(**run)
        Path(run["out"]).mkdir(parents=True, exist_ok=True)
        Path(run["out"], f"rank_{dist.get_rank()}.json").write_text(json.dumps(result))
