"""Checks around checkpoint files, each turning a deep library error into one line that names
the file and what to do:

- ``manifest.json``: every file of a checkpoint and its size, written when the save is complete
  and checked before a load, so a truncated ``.distcp``, ``.metadata`` or rank file is named
  (instead of an ``EOFError`` from deep in torch) together with the previous complete checkpoint;
- ``shape_mismatch``: the model's tensors against the checkpoint's metadata, before megatron's
  load (a 21,000-character ``KeyError`` for another ``num_layers``);
- ``is_disk_full``: ENOSPC, however deeply torch's distributed checkpoint wrapped it.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

from core.errors import CheckpointError, one_line

MANIFEST = "manifest.json"
MAX_LISTED = 10  # differing tensors named in a mismatch message


# ---------------------------------------------------------------- manifest


def write_manifest(directory: Path, skip: tuple[str, ...] = ("trainer_state.json",)) -> None:
    """Record every file under ``directory`` (relative path -> bytes). ``trainer_state.json`` is
    written after it and marks the checkpoint complete, so it is not listed."""
    files = {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name not in skip and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps(files, indent=0))


def manifest_problem(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint, naming the file; None when it is (or when
    it predates manifests and only its trainer_state.json can be checked)."""
    state = directory / "trainer_state.json"
    if not state.is_file():
        return f"{state} is missing (the save did not finish)"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as e:
        return f"{state} is corrupt ({one_line(e)})"
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path} is corrupt ({one_line(e)})"
    for name, size in files.items():
        f = directory / name
        if not f.is_file():
            return f"{f} is missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{f} is truncated or damaged ({actual} bytes, {size} when it was written)"
    return None


def previous_complete(directory: Path) -> Path | None:
    """The newest complete checkpoint beside ``directory`` with a lower iteration."""
    try:
        here = int(directory.name.split("_")[1].split(".")[0])
    except (IndexError, ValueError):
        here = None
    candidates = []
    for p in directory.parent.glob("iter_*"):
        if not p.is_dir() or p.name.endswith(".tmp") or p == directory:
            continue
        try:
            it = int(p.name[5:])
        except ValueError:
            continue
        if here is None or it < here:
            candidates.append((it, p))
    for _, p in sorted(candidates, reverse=True):
        if manifest_problem(p) is None:
            return p
    return None


def corrupt(directory: Path, problem: str) -> CheckpointError:
    """The one-line error for a checkpoint that cannot be read, with the way back."""
    prev = previous_complete(directory)
    back = (f"the previous complete checkpoint is {prev.name}: resume with checkpoint.load={prev}"
            if prev is not None else "no earlier complete checkpoint was found beside it")
    return CheckpointError(f"checkpoint {directory} cannot be loaded: {problem}; {back}")


# ---------------------------------------------------------------- shapes


def expected_shapes(sharded_state: dict) -> dict[str, tuple]:
    """key -> global shape of every ShardedTensor (factories applied) of a sharded state dict."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    shapes = {}

    def visit(v):
        if isinstance(v, ShardedTensorFactory):  # built into a dict, a list or one tensor
            built = v.build()
            for inner in nested_values(built) if isinstance(built, (dict, list)) else [built]:
                visit(inner)
        elif isinstance(v, ShardedTensor):
            shapes[v.key] = tuple(v.global_shape)

    for value in nested_values(sharded_state):
        visit(value)
    return shapes


def stored_shapes(directory: Path) -> dict[str, tuple]:
    """key -> global shape of every tensor in a torch_dist checkpoint (its .metadata file)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(directory)).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def config_differences(directory: Path, model_config: dict | None) -> list[str]:
    """``model.<field> <stored> in the checkpoint, <ours> here`` for architecture fields that differ."""
    path = directory / "model_config.json"
    if model_config is None or not path.is_file():
        return []
    try:
        stored = json.loads(path.read_text())
    except ValueError:
        return []
    out = []
    for key, ours in model_config.items():
        if key in stored and stored[key] != ours and not isinstance(ours, dict):
            out.append(f"model.{key} {stored[key]} in the checkpoint, {ours} here")
    return out


def shape_mismatch(directory: Path, expected: dict[str, tuple], stored: dict[str, tuple],
                   model_config: dict | None = None, whole_model: bool = True) -> CheckpointError | None:
    """One line listing at most ``MAX_LISTED`` tensors whose shapes differ (or that one side lacks).
    ``whole_model=False`` (a pipeline stage, which holds only its own layers): tensors of the
    checkpoint that this rank does not hold are other stages', not a difference."""
    diffs = []
    for key, shape in expected.items():
        if key not in stored:
            diffs.append(f"{key} {list(shape)} here, missing in the checkpoint")
        elif stored[key] != shape:
            diffs.append(f"{key} {list(stored[key])} in the checkpoint, {list(shape)} here")
    prefixes = {k.split(".")[0] for k in expected}  # (the optimizer's keys are checked by their model keys)
    for key in stored if whole_model else ():
        if key not in expected and key.split(".")[0] in prefixes:
            diffs.append(f"{key} {list(stored[key])} in the checkpoint, not in this model")
    if not diffs:
        return None
    fields = config_differences(directory, model_config)
    head = f" ({'; '.join(fields)})" if fields else ""
    more = f"; and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
    return CheckpointError(f"checkpoint {directory} was written by another model{head}: {len(diffs)} tensor(s) "
                           f"differ: {'; '.join(diffs[:MAX_LISTED])}{more}; load it with the model settings it "
                           "was written with, or start without checkpoint.load")


# ---------------------------------------------------------------- disk full


class WriterErrors(logging.Handler):
    """megatron's checkpoint writer threads catch their OSError, log it and re-raise only its class
    ("Worker failure ... <class 'OSError'>"): the cause survives only in that log record, so the
    save listens for it."""

    LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self)


def is_disk_full(e: BaseException, logged: list[str] = (), free_bytes: int | None = None,
                 need_bytes: int = 0) -> bool:
    """ENOSPC anywhere in the chain (torch DCP's per-rank failures included), in what megatron's
    writer logged in this process (``WriterErrors``), or an OSError whose errno megatron's writer
    process dropped (it reports only the class) while the disk has less room than the save needs."""
    if any("No space left on device" in m or "[Errno 28]" in m for m in logged):
        return True
    if free_bytes is not None and free_bytes < need_bytes and "OSError" in _chain_text(e):
        return True
    return any((isinstance(x, OSError) and x.errno == errno.ENOSPC) or "No space left on device" in str(x)
               for x in _chain(e))


def _chain(e: BaseException):
    """``e`` and every exception behind it: causes, contexts, and the per-rank failures a
    torch.distributed.checkpoint CheckpointException carries."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, (tuple, BaseException))]


def _chain_text(e: BaseException) -> str:
    return " | ".join(f"{type(x).__name__}: {x}" for x in _chain(e))


def free_bytes(path) -> int | None:
    import shutil

    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def tensor_bytes(sharded_state: dict) -> int:
    """Bytes of this rank's tensors in a sharded state dict (what the save needs, roughly)."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    total = 0
    for v in nested_values(sharded_state):
        data = getattr(v, "data", v)
        if torch.is_tensor(data):
            total += data.numel() * data.element_size()
    return total
