"""Checkpoints: megatron-core dist-checkpointing for model + optimizer, plus trainer state.

Layout of ``checkpoint.dir``::

    iter_0000020/                  model and optimizer (sharded, layout independent)
        trainer_state.json         iteration, LR scheduler, written last by rank 0
        rank_state/rank00000.pt    per-rank RNG streams and data-iterator position
    latest                         name of the newest complete checkpoint

Atomicity: everything is written into ``iter_XXXXXXX.tmp``; after every rank finished,
rank 0 renames it and then replaces ``latest`` (write + rename). A crash mid-save leaves a
``.tmp`` directory that is never loaded, and the previous checkpoint stays intact.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

log = logging.getLogger(__name__)


def _iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# megatron's distributed optimizer defaults to its "fully_sharded_model_space" layout, whose
# flattened ShardedTensors megatron-core 0.19's own dist_checkpointing refuses at save time
# ("ShardedTensor.flattened_range is not supported"). "dp_reshardable" (Megatron-LM's default):
# each rank writes its own bucket shards, no gather; megatron documents DP resharding for it (a
# DP=2 checkpoint loaded at DP=1 by hand; not tested).
# ("fully_reshardable" gathers every rank's state on DP rank 0.) Other optimizers ignore it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state(model, optimizer, is_loading: bool) -> dict:
    model_sd = model.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                         metadata=dict(OPTIMIZER_METADATA))}


def _write(root: Path, iteration: int, sharded: dict, trainer: dict, meta_files: dict[str, str] | None,
           rank_payload: dict | None = None, keep_last: int = 0) -> Path:
    """The atomic protocol every checkpoint uses: write into iter_X.tmp, wait for every rank,
    then rank 0 adds the metadata, renames the directory and replaces ``latest``."""
    final = root / _iter_name(iteration)
    tmp = root / (final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sharded, str(tmp))
    if rank_payload is not None:
        (tmp / "rank_state").mkdir(exist_ok=True)
        torch.save(rank_payload, tmp / "rank_state" / f"rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        for name, text in (meta_files or {}).items():
            (tmp / name).write_text(text)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer))  # last: marks the dir complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        _prune(root, keep_last)
        log.info("saved checkpoint %s", final)
    dist.barrier()
    return final


def save(ckpt_dir: str, iteration: int, model, optimizer, scheduler, data_state: dict, keep_last: int = 0,
         meta_files: dict[str, str] | None = None) -> Path:
    """A training checkpoint. meta_files: small text files written beside the weights
    (model_config.json, hf_config.json) so export and later tools know the architecture."""
    # the trainer checks the weights before every save (multimodal/nonfinite.py): pruning keeps
    # the newest checkpoint marked so
    trainer = {"iteration": iteration, "scheduler": scheduler.state_dict(), "world_size": dist.get_world_size(),
               "finite": True}
    return _write(Path(ckpt_dir), iteration, _sharded_state(model, optimizer, is_loading=False), trainer,
                  meta_files, {"rng": _rng_state(), "data": data_state}, keep_last)


def _prune(root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints, and always the newest one whose weights were
    checked finite when it was written (older checkpoints carry no such mark)."""
    if keep_last <= 0:
        return
    done = sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    finite = [p for p in done if _trainer_state(p).get("finite")]
    keep = set(done[-keep_last:]) | set(finite[-1:])
    for old in done:
        if old not in keep:
            shutil.rmtree(old)


def _trainer_state(path: Path) -> dict:
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}


def resolve(load: str, ckpt_dir: str | None) -> Path | None:
    """Path of the checkpoint to load, or None when 'latest' finds nothing (fresh start)."""
    if load == "latest":
        marker = Path(ckpt_dir) / "latest"
        if not marker.is_file():
            return None
        path = Path(ckpt_dir) / marker.read_text().strip()
    else:
        path = Path(load)
        if (path / "latest").is_file():  # a checkpoint.dir was given: take its newest
            path = path / (path / "latest").read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no trainer_state.json); "
            "point checkpoint.load at an iter_XXXXXXX directory or a checkpoint.dir with a 'latest' file"
        )
    return path


def save_weights(ckpt_dir: str | Path, model, extra: dict | None = None,
                 meta_files: dict[str, str] | None = None) -> Path:
    """A weights-only checkpoint (e.g. converted from Hugging Face): training starts at step 0
    from these weights with a fresh optimizer."""
    trainer = {"iteration": 0, "weights_only": True, **(extra or {})}
    return _write(Path(ckpt_dir), 0, {"model": model.sharded_state_dict()}, trainer, meta_files)


def load_weights(path: Path, model) -> dict:
    """Load only the model weights of any checkpoint (under any TP/EP layout); returns trainer_state."""
    trainer = json.loads((path / "trainer_state.json").read_text())
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(state["model"])
    return trainer


def _prime_distributed_optimizer_state(optimizer) -> None:
    """Give megatron's distributed optimizer a torch state to describe before a resume.

    Without TransformerEngine/Apex its ``state_dict()`` reads the step from torch's per-parameter
    state, which is empty until the first step (torch allocates it lazily), and asserts. Zeros and
    step 0 stand in; the load then overwrites them. Under flat AdamW the flat moments are bound
    instead (no second copy of the moments)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or adam is None or any(adam.state.values()):
            continue
        flat = getattr(adam, "flat_adamw", None)
        if flat is not None:
            flat.bind_state()
            continue
        for group in adam.param_groups:
            for p in group["params"]:
                adam.state[p] = {"step": _step_tensor(0.0, group, p), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}


def _step_tensor(value: float, group: dict, param: torch.Tensor) -> torch.Tensor:
    """An AdamW step where torch keeps it: on the parameter's device for fused/capturable groups."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(value, dtype=torch.float32, device=param.device if on_device else "cpu")


def _restore_steps(optimizer) -> None:
    """Set every parameter's AdamW ``step`` after a distributed-optimizer load, each its own tensor.

    Without TransformerEngine/Apex megatron's distributed optimizer saves the step in its param
    groups, and its load then puts one shared tensor into every parameter's state and copies the
    per-parameter steps of the state it described before the load (the primed zeros) over it.
    torch's AdamW increments each parameter's step in place, so a shared tensor would also advance
    once per parameter per step. The param groups' step is the saved one. Flat AdamW keeps its
    count itself (and shares its step tensor on purpose). The other optimizers restore one step
    per parameter themselves (megatron's common_step, copied per parameter)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(opt, "optimizer", None)
        saved = {float(g["step"]) for g in adam.param_groups if "step" in g} if adam is not None else set()
        if not isinstance(opt, DistributedOptimizer) or len(saved) != 1:
            continue
        step = saved.pop()
        flat = getattr(adam, "flat_adamw", None)
        if flat is not None:
            flat.set_step(int(step))
            continue
        for group in adam.param_groups:
            for p in group["params"]:
                adam.state[p]["step"] = _step_tensor(step, group, p)


def load(path: Path, model, optimizer, scheduler) -> tuple[int, dict | None]:
    """Restore model, optimizer, scheduler and this rank's RNG; returns (iteration, data_state).
    A weights-only checkpoint restores the model and starts at iteration 0."""
    trainer = json.loads((path / "trainer_state.json").read_text())
    if trainer.get("weights_only"):
        load_weights(path, model)
        log.info("loaded weights from %s (weights-only checkpoint: optimizer and step start fresh)", path)
        return 0, None
    _prime_distributed_optimizer_state(optimizer)
    state = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path))
    model.load_state_dict(state["model"])
    with torch.no_grad():  # the distributed optimizer copies into fp32 shards that are views of parameters
        optimizer.load_state_dict(state["optimizer"])
    _restore_steps(optimizer)
    scheduler.load_state_dict(trainer["scheduler"])
    rank_file = path / "rank_state" / f"rank{dist.get_rank():05d}.pt"
    data_state = None
    if rank_file.is_file() and trainer.get("world_size") == dist.get_world_size():
        rank_state = torch.load(rank_file, weights_only=False)
        _set_rng_state(rank_state["rng"])
        data_state = rank_state["data"]
    else:
        log.warning("checkpoint was written by another world size: RNG and data position restart per rank")
    log.info("loaded checkpoint %s (iteration %d)", path, trainer["iteration"])
    return trainer["iteration"], data_state
