"""Checkpoints: megatron-core dist-checkpointing for model + optimizer, plus trainer state.

Layout of ``checkpoint.dir``::

    iter_0000020/                  model and optimizer (sharded, layout independent)
        trainer_state.json         iteration, LR scheduler, written last by rank 0
        rank_state/rank00000.pt    per-rank RNG streams and data-iterator position
    latest                         name of the newest complete checkpoint

Atomicity: everything is written into ``iter_XXXXXXX.tmp``; after every rank finished,
rank 0 records every file's size in ``manifest.json``, writes ``trainer_state.json``, renames the
directory and then replaces ``latest`` (write + rename). A crash mid-save leaves a ``.tmp``
directory that is never loaded, and the previous checkpoint stays intact; a full disk removes it.

Loading checks the manifest first (multimodal/checkpoint_checks.py), so a truncated or missing
file is named with the previous complete checkpoint, and compares the model's tensor shapes with
the checkpoint's before megatron reads any of it. Rank files load with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps

from models.common.lora import is_adapter_param
from models.common.virtual_pipeline import as_one_module
from multimodal import checkpoint_checks as checks
# the folder's side (which checkpoints it holds, which to load or prune, may this run write there),
# re-exported: callers use the checkpoint API from here
from multimodal.checkpoint_dir import (check_free_space, check_writable, prune, resolve, start_run,  # noqa: F401
                                       trainer_state)
from core.errors import CheckpointError, DiskFullError, one_line

log = logging.getLogger(__name__)


def _iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rng_state() -> dict:
    """Plain types and tensors only, so ``torch.load(weights_only=True)`` reads it back."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(_as_tuples(state["python"]))
    n = state["numpy"]
    if isinstance(n, dict):
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    else:  # written before the plain form: numpy's own tuple
        np.random.set_state(n)
    torch.set_rng_state(state["torch"])
    if "tracker" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(x):
    """random.setstate wants tuples; a weights_only load may give lists back."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _load_rank_file(path: Path) -> dict:
    """A rank's RNG and data state without running pickled code: ``weights_only=True``, with the
    numpy types older checkpoints stored their RNG state in allowed explicitly."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    # the name a pickle refers to depends on the numpy that wrote it
    safe = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), (_reconstruct, "numpy.core.multiarray._reconstruct"),
            (_reconstruct, "numpy._core.multiarray._reconstruct")]
    try:
        with torch.serialization.safe_globals(safe):
            return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, or not ours: all named the same way
        raise checks.corrupt(path.parent.parent, f"{path} does not load ({one_line(e)})") from e


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


def writer_threads() -> int:
    """Files each rank writes in parallel: one writer thread (megatron's default) left a fast disk
    mostly idle; the node's cores are shared by its ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // local))


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=writer_threads())


@contextlib.contextmanager
def _in_process_write_results():
    """megatron's file writer reports its results through a module-level multiprocessing Manager
    queue that it starts with "spawn" at the first save: a process that imports the main script
    again (torch and megatron, seconds) before it answers. A synchronous save writes in this
    process, so a plain queue serves it; megatron's own stays for an asynchronous save's writer
    process (multimodal/async_saves.py starts it early)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    held = fa._results_queue
    fa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fa._results_queue = held


def _with_checksums(request, tmp: Path, rank: int, name: str):
    """The async write, followed by the crc32 of this rank's files and one line with the write's
    rate, all in megatron's writer process: nothing of it waits in the training process."""
    write = request.async_fn
    if write is None:
        return request

    def run(*args, **kwargs):
        t0 = time.perf_counter()
        out = write(*args, **kwargs)
        seconds = time.perf_counter() - t0
        nbytes = sum(p.stat().st_size for p in tmp.glob(f"__{rank}_*.distcp"))
        t1 = time.perf_counter()
        checks.write_rank_checksums(tmp, rank)
        if rank == 0:
            log.info("checkpoint %s: rank 0 wrote %.2f GB in %.1f s (%.2f GB/s, %d writer threads), crc32 in %.1f s",
                     name, nbytes / 1e9, seconds, nbytes / 1e9 / max(seconds, 1e-9), writer_threads(),
                     time.perf_counter() - t1)
        return out

    return request._replace(async_fn=run)


def _write(root: Path, iteration: int, sharded: dict, trainer: dict, meta_files: dict[str, str] | None,
           rank_payload: dict | None = None, keep_last: int = 0, saves=None) -> Path:
    """The atomic protocol every checkpoint uses: write into iter_X.tmp, wait for every rank,
    then rank 0 adds the metadata, renames the directory and replaces ``latest``. ``saves``
    (multimodal/async_saves.py): the tensors are copied to host memory here and written by a
    background process; everything after (``_commit``) runs once every rank's write is done."""
    final = root / _iter_name(iteration)
    tmp = root / (final.name + ".tmp")
    rank = dist.get_rank()
    writer_errors = checks.WriterErrors()
    need = checks.tensor_bytes(sharded) * dist.get_world_size()
    try:
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        if saves is not None:
            saves.ready()
        with writer_errors, (_in_process_write_results() if saves is None else contextlib.nullcontext()):
            # "mcore": megatron's own writer process (its default, "nvrx", needs nvidia-resiliency-ext)
            request = dist_checkpointing.save(sharded, str(tmp), sharded_strategy=_save_strategy(),
                                              async_sharded_save=saves is not None, async_strategy="mcore")
        if saves is None:
            checks.write_rank_checksums(tmp, rank)
        else:
            request = _with_checksums(request, tmp, rank, final.name)
        if rank_payload is not None:  # small: written now, in this process
            (tmp / "rank_state").mkdir(exist_ok=True)
            torch.save(rank_payload, tmp / "rank_state" / f"rank{rank:05d}.pt")
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        error = disk_full_or(e, root, tmp, need, writer_errors.messages)
        if error is e:
            raise
        raise error from e
    commit = functools.partial(_commit, root, tmp, final, trainer, meta_files, keep_last, need)
    if saves is None:
        commit()
    else:
        saves.submit(request, commit, root, tmp, need)
    return final


def disk_full_or(e: BaseException, root: Path, tmp: Path, need: int, logged=()) -> BaseException:
    """A DiskFullError (partial files removed) when ``e`` is one, else ``e`` itself."""
    if checks.is_disk_full(e, logged, checks.free_bytes(root), need):
        return _disk_full(root, tmp, need)
    return e


def _commit(root: Path, tmp: Path, final: Path, trainer: dict, meta_files: dict[str, str] | None, keep_last: int,
            need: int) -> None:
    """Every rank wrote its files: record them, mark the directory complete, move ``latest``."""
    dist.barrier()
    if dist.get_rank() == 0:
        try:
            for name, text in (meta_files or {}).items():
                (tmp / name).write_text(text)
            checks.write_manifest(tmp)
            (tmp / "trainer_state.json").write_text(json.dumps(trainer))  # last: marks the dir complete
        except BaseException as e:
            error = disk_full_or(e, root, tmp, need)
            if error is e:
                raise
            raise error from e
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        prune(root, keep_last, final, trainer.get("lineage"))
        log.info("saved checkpoint %s", final)
    dist.barrier()


def _disk_full(root: Path, tmp: Path, need: int) -> DiskFullError:
    """Remove the partial checkpoint and say how much room a save needs."""
    shutil.rmtree(tmp, ignore_errors=True)
    (root / "latest.tmp").unlink(missing_ok=True)
    free_now = checks.free_bytes(root)
    free = f", {free_now / 2**20:.1f} MiB free" if free_now is not None else ""
    marker = root / "latest"
    kept = (f"the previous checkpoint {marker.read_text().strip()} is intact" if marker.is_file()
            else "no earlier checkpoint exists")
    return DiskFullError(f"no space left on device writing checkpoint {tmp.name[:-4]} under {root} (about "
                         f"{need / 2**20:.1f} MiB needed{free}); the partial files were removed and {kept}; "
                         "free space there, point checkpoint.dir elsewhere or set checkpoint.keep_last")


def save(ckpt_dir: str, iteration: int, model, optimizer, scheduler, data_state: dict, keep_last: int = 0,
         meta_files: dict[str, str] | None = None, saves=None, extra: dict | None = None) -> Path:
    """A training checkpoint. meta_files: small text files written beside the weights
    (model_config.json, hf_config.json) so export and later tools know the architecture.
    ``extra``: more trainer-state fields (the run's lineage, the loss / grad-norm history)."""
    # the trainer checks the weights before every save (multimodal/nonfinite.py): pruning keeps
    # the newest checkpoint marked so
    t0 = time.perf_counter()
    trainer = {"iteration": iteration, "scheduler": scheduler.state_dict(), "world_size": dist.get_world_size(),
               "finite": True, "distributed_optimizer_layout": _optimizer_layout(optimizer),
               **_data_parallel_map(data_state), **(extra or {})}
    sharded = _sharded_state(as_one_module(model), optimizer, is_loading=False)
    t1 = time.perf_counter()
    final = _write(Path(ckpt_dir), iteration, sharded, trainer, meta_files, {"rng": _rng_state(), "data": data_state},
                   keep_last, saves)
    if saves is not None and dist.get_rank() == 0:  # what of an asynchronous save training waited for
        log.info("checkpoint %s: training paused %.2f s (state dicts %.2f s; megatron's save planning, host "
                 "staging and the writer's start %.2f s); the files are written in the background",
                 final.name, time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1)
    return final


def _optimizer_layout(optimizer) -> dict | None:
    """The model-parallel layout that megatron's distributed optimizer's stored state belongs to
    (its ``dp_reshardable`` format keeps each rank's gradient-bucket shards, which exist only for
    that TP/PP/VPP/EP split), or None for any other optimizer (its state has global keys)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if not ps.model_parallel_is_initialized() or not any(isinstance(o, DistributedOptimizer) for o in parts):
        return None
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            "ep": ps.get_expert_model_parallel_world_size()}


def _check_optimizer_layout(path: Path, trainer: dict, optimizer) -> None:
    saved, now = trainer.get("distributed_optimizer_layout"), _optimizer_layout(optimizer)
    if saved is not None and saved != now:
        def fmt(layout):
            return " ".join(f"{k}={v}" for k, v in layout.items()) if layout else "without the distributed optimizer"

        raise CheckpointError(
            f"{path} holds distributed-optimizer state of the layout {fmt(saved)}, stored per gradient bucket of "
            f"that layout; this run is {fmt(now)}: resume with the saved parallel.tp/pp/vpp/ep and "
            "parallel.use_distributed_optimizer=true (checkpoints of the plain optimizer load under any layout)")


def _data_parallel_map(data_state: dict | None) -> dict:
    """What a resume under another layout needs, in one small all-gather at save time:
    - the data-parallel size and each global rank's data-parallel rank: a resume under another
      TP / PP / CP layout with the same data-parallel size finds in them the rank file that holds
      its data position;
    - the smallest sample index any rank has not consumed yet (read-ahead samples count as unread)
      and the largest next index: a resume at another data-parallel size continues the data order
      from the first, re-reading at most the samples between the two instead of restarting at 0."""
    if not ps.model_parallel_is_initialized():
        return {}
    position = None
    if data_state and "next_index" in data_state:
        nxt = int(data_state["next_index"])
        position = (nxt, min([nxt, *map(int, data_state.get("pending", []))]))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ps.get_data_parallel_rank(), position))
    out = {"data_parallel_size": ps.get_data_parallel_world_size(), "data_parallel_ranks": [r for r, _ in every]}
    positions = [pos for _, pos in every if pos is not None]
    if positions:
        out.update(data_frontier=min(u for _, u in positions), data_next_max=max(n for n, _ in positions))
    return out


def _rank_file_for(path: Path, trainer: dict) -> tuple[Path | None, bool]:
    """(the rank file whose RNG and data position this rank continues, whether it was written by
    this very rank under the same world size). Under another world size with the same data-parallel
    size (TP, PP or CP changed), every rank of a data-parallel rank read the same samples, so the
    first one's file serves; otherwise None: the data order restarts."""
    own = path / "rank_state" / f"rank{dist.get_rank():05d}.pt"
    if trainer.get("world_size") == dist.get_world_size():
        return (own if own.is_file() else None), True
    ranks = trainer.get("data_parallel_ranks")
    if not ranks or trainer.get("data_parallel_size") != ps.get_data_parallel_world_size():
        return None, False
    source = path / "rank_state" / f"rank{ranks.index(ps.get_data_parallel_rank()):05d}.pt"
    return (source if source.is_file() else None), False


def estimate_bytes(model, world_size: int) -> tuple[int, str]:
    """About the bytes of one training checkpoint of every rank together, from the parameter
    counts (weights in their dtype; for trainable ones fp32 main copies unless fp32 already, and
    two fp32 Adam moments), and how it was counted. Ranks of one data-parallel group hold the
    same weights, so this rank's count is scaled by the model-parallel size."""
    model = as_one_module(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(p.numel() * (8 + (0 if p.dtype == torch.float32 else 4)) for p in model.parameters() if p.requires_grad)
    model_parallel = world_size // ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    count = sum(p.numel() for p in model.parameters())
    return (weights + state) * model_parallel, (f"{count / 1e6:.1f}M parameters per rank x {model_parallel} "
                                                "model-parallel rank(s): weights, fp32 main copies, Adam moments")


def save_weights(ckpt_dir: str | Path, model, extra: dict | None = None,
                 meta_files: dict[str, str] | None = None) -> Path:
    """A weights-only checkpoint (e.g. converted from Hugging Face): training starts at step 0
    from these weights with a fresh optimizer."""
    trainer = {"iteration": 0, "weights_only": True, **(extra or {})}
    return _write(Path(ckpt_dir), 0, {"model": as_one_module(model).sharded_state_dict()}, trainer, meta_files)


def load_weights(path: Path, model) -> dict:
    """Load only the model weights of any checkpoint (under any TP/EP layout); returns trainer_state."""
    trainer = json.loads((path / "trainer_state.json").read_text())
    model = as_one_module(model)
    sharded = model.sharded_state_dict()
    fresh = _adapters_not_in(path, sharded)
    state = dist_checkpointing.load({"model": {k: v for k, v in sharded.items() if k not in fresh}}, str(path))
    if fresh:  # a base-only checkpoint (e.g. converted from HF) under a LoRA model: adapters start fresh
        log.info("%s has no LoRA adapters: %d adapter tensors keep their initial values", path, len(fresh))
        current = model.state_dict()
        state["model"].update({k: current[k] for k in fresh})
    model.load_state_dict(state["model"])
    return trainer


def _adapters_not_in(path: Path, sharded: dict) -> set[str]:
    """The LoRA adapter entries of ``sharded`` that the checkpoint at ``path`` does not hold."""
    adapters = {k for k in sharded if is_adapter_param(k)}
    if not adapters:
        return set()
    saved = dist_checkpointing.load_tensors_metadata(str(path))
    # an adapter split like its base weight may be stored as several tensors (fc1's gate / up, GDN in_proj)
    return {k for k in adapters if not set(checks.expected_shapes({k: sharded[k]})) & set(saved)}


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


def check_loadable(path: Path, model, model_config: dict | None = None, trust: bool = True) -> dict:
    """Every file complete (sizes and crc32) and the model's shapes those of the checkpoint; returns
    trainer_state. Raises CheckpointError naming the file (and the previous complete checkpoint) or
    the tensors. ``trust=False``: a checkpoint without this framework's manifest is refused before
    torch's reader unpickles anything of it."""
    problem = checks.manifest_problem(path, verify=False) or _checksums_shared(path)
    if problem is not None:
        raise checks.corrupt(path, problem)
    if not trust and (why := checks.untrusted(path)) is not None:
        raise CheckpointError(f"{why}; load it only if you trust where it came from, with checkpoint.trust=true")
    trainer = json.loads((path / "trainer_state.json").read_text())
    try:
        stored = checks.stored_shapes(path)
    except Exception as e:  # noqa: BLE001 - a damaged .metadata in a checkpoint without a manifest
        raise checks.corrupt(path, f"{path / '.metadata'} does not load ({one_line(e)})") from e
    whole = not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1
    sharded = as_one_module(model).sharded_state_dict()
    if trainer.get("weights_only"):  # a base-only checkpoint under model.lora: the adapters start fresh
        fresh = _adapters_not_in(path, sharded)
        sharded = {k: v for k, v in sharded.items() if k not in fresh}
    mismatch = checks.shape_mismatch(path, checks.expected_shapes({"model": sharded}), stored,
                                     model_config, whole_model=whole)
    if mismatch is not None:
        raise mismatch
    return trainer


def _checksums_shared(path: Path) -> str | None:
    """The checksum check of a load, its files shared out among the ranks (each would otherwise
    read the whole checkpoint); every rank gets the first problem any of them found."""
    files = checks.read_manifest(path)  # readable: manifest_problem checked it
    if not files:
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = checks.checksum_problem(path, files, (rank, world))
    if world == 1:
        return mine
    found = [None] * world
    dist.all_gather_object(found, mine)
    return next((p for p in found if p), None)


SCHEDULE_FIELDS = {"max_lr": "optimizer.lr", "min_lr": "optimizer.min_lr", "lr_warmup_steps": "optimizer.warmup_iters",
                   "lr_decay_steps": "optimizer.decay_iters / train.iters", "lr_decay_style": "optimizer.lr_decay_style",
                   "start_wd": "optimizer.weight_decay"}
GROUP_SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")  # per param group, set from the config


def _load_schedule(scheduler, saved: dict) -> None:
    """The step count from the checkpoint, the schedule from this run's config: megatron's own load
    would keep the checkpoint's warm-up, LR and length in silence (and assert on a difference
    when told not to)."""
    changed = [f"{name} {saved[key]} -> {getattr(scheduler, key)}" for key, name in SCHEDULE_FIELDS.items()
               if key in saved and saved[key] != getattr(scheduler, key)]
    scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
    megatron_log = logging.getLogger("megatron.core.optimizer_param_scheduler")
    level = megatron_log.level
    megatron_log.setLevel(logging.WARNING)  # its one line per field ("overriding ...")
    try:
        scheduler.load_state_dict(saved)
    finally:
        megatron_log.setLevel(level)
    if changed:
        log.info("resuming with another LR schedule: %s; the schedule is rebuilt from this config at step %d "
                 "(lr now %.3g)", ", ".join(changed), scheduler.num_steps,
                 scheduler.get_lr(scheduler.optimizer.param_groups[0]))


def _current_schedule_in_groups(optimizer, saved) -> None:
    """Give the checkpoint's param groups this run's max_lr / min_lr / weight decay before the
    optimizer's load: megatron matches saved groups to current ones by those values too, and a
    changed optimizer.lr would not be found ("Could not find parameter group with key")."""
    structural = lambda g: tuple(g.get(k) for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr",
                                                     "optimizer"))
    current = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for g in getattr(inner, "param_groups", []):
            current.setdefault(structural(g), {k: g[k] for k in GROUP_SCHEDULE_KEYS if k in g})
    stack = [saved]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            groups = x.get("param_groups")
            if isinstance(groups, list):
                for g in groups:
                    if isinstance(g, dict) and structural(g) in current:
                        g.update(current[structural(g)])
            stack.extend(v for k, v in x.items() if k != "param_groups")
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def _read(path: Path, what: str, fn):
    """megatron's load, any failure named with the checkpoint and the previous complete one."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise checks.corrupt(path, f"reading {what} failed ({type(e).__name__}: {one_line(e)[:300]})") from e


def load(path: Path, model, optimizer, scheduler, model_config: dict | None = None,
         trust: bool = True) -> tuple[int, dict | None]:
    """Restore model, optimizer, scheduler and this rank's RNG; returns (iteration, data_state).
    A weights-only checkpoint restores the model and starts at iteration 0. ``model_config``: this
    run's model fields, named in the message when the checkpoint's differ. The LR schedule is this
    run's config's (a changed optimizer.lr, warm-up or train.iters is said in one line). ``model``: the
    model or this rank's list of chunks (virtual pipeline stages), as for ``save``."""
    model = as_one_module(model)
    trainer = check_loadable(path, model, model_config, trust)
    if trainer.get("weights_only"):
        _read(path, "the weights", lambda: load_weights(path, model))
        log.info("loaded weights from %s (weights-only checkpoint: optimizer and step start fresh)", path)
        return 0, None
    _check_optimizer_layout(path, trainer, optimizer)
    _prime_distributed_optimizer_state(optimizer)
    state = _read(path, "the model and optimizer tensors",
                  lambda: dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path)))
    model.load_state_dict(state["model"])
    _current_schedule_in_groups(optimizer, state["optimizer"])
    with torch.no_grad():  # the distributed optimizer copies into fp32 shards that are views of parameters
        optimizer.load_state_dict(state["optimizer"])
    _restore_steps(optimizer)
    _load_schedule(scheduler, trainer["scheduler"])
    rank_file, same_layout = _rank_file_for(path, trainer)
    data_state = None
    if rank_file is not None:
        rank_state = _load_rank_file(rank_file)
        rng = rank_state["rng"]
        if not same_layout:
            # megatron's tensor-parallel RNG streams belong to the writer's TP rank: keep this
            # rank's own (they only feed dropout inside tensor-parallel regions)
            rng = {k: v for k, v in rng.items() if k != "tracker"}
            log.info("checkpoint was written under another layout with the same data-parallel size: the "
                     "data position and RNG continue from %s", rank_file.name)
        _set_rng_state(rng)
        data_state = rank_state["data"]
    elif "data_frontier" in trainer:
        frontier, dp = int(trainer["data_frontier"]), ps.get_data_parallel_world_size()
        data_state = {"next_index": frontier + ps.get_data_parallel_rank(), "pending": []}
        log.warning("checkpoint was written at data-parallel size %s, this run has %d: the data order continues "
                    "from sample %d (up to %d samples the old ranks had read past it are read again); RNG "
                    "restarts per rank", trainer.get("data_parallel_size"), dp, frontier,
                    int(trainer["data_next_max"]) - frontier)
    else:
        log.warning("checkpoint was written with another data-parallel size: RNG and data position restart "
                    "per rank")
    log.info("loaded checkpoint %s (iteration %d)", path, trainer["iteration"])
    return trainer["iteration"], data_state
