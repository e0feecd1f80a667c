"""Checks around checkpoint files, each turning a deep library error into one line that names
the file and what to do:

- ``manifest.json``: every file of a checkpoint, its size and crc32, written when the save is
  complete and checked before a load, so a truncated or garbled ``.distcp``, ``.metadata`` or
  rank file is named (instead of an ``EOFError`` from deep in torch, or weights that load and
  diverge) together with the previous complete checkpoint;
- ``shape_mismatch``: the model's tensors against the checkpoint's metadata, before megatron's
  load (a 21,000-character ``KeyError`` for another ``num_layers``);
- ``is_disk_full``: ENOSPC, however deeply torch's distributed checkpoint wrapped it.
"""

from __future__ import annotations

import errno
import json
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.errors import CheckpointError, one_line

MANIFEST = "manifest.json"
MAX_LISTED = 10  # differing tensors named in a mismatch message


# ---------------------------------------------------------------- manifest

MANIFEST_FORMAT = "qwen35-vl-train checkpoint manifest 2"  # what marks a checkpoint as written by us
CHECKSUMS = "checksums"  # per-rank crc32 of the shards each rank wrote (folded into the manifest)
CHUNK = 16 << 20


def file_crc32(path: Path) -> str:
    """crc32 of a file, read in chunks (zlib releases the GIL: files hash in parallel threads)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def crc32_of(paths: list[Path], threads: int = 8) -> dict[Path, str]:
    if len(paths) <= 1:
        return {p: file_crc32(p) for p in paths}
    with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as pool:
        return dict(zip(paths, pool.map(file_crc32, paths)))


def write_rank_checksums(directory: Path, rank: int, threads: int = 8) -> None:
    """crc32 of the shard files rank ``rank`` wrote (``__<rank>_*.distcp``), into
    ``checksums/rank<rank>.json``: run where the files were written (the async writer process),
    so the manifest need not read every byte again on rank 0 while training waits."""
    directory = Path(directory)
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    sums = {p.name: {"bytes": p.stat().st_size, "crc32": c} for p, c in crc32_of(files, threads).items()}
    (directory / CHECKSUMS).mkdir(exist_ok=True)
    (directory / CHECKSUMS / f"rank{rank:05d}.json").write_text(json.dumps(sums))


def write_manifest(directory: Path, skip: tuple[str, ...] = ("trainer_state.json",)) -> None:
    """Record every file under ``directory``: its bytes and crc32. Checksums the ranks computed
    where they wrote (``write_rank_checksums``) are taken when the size still matches; every other
    file is read here. ``trainer_state.json`` is written after it and marks the checkpoint
    complete, so it is not listed."""
    directory = Path(directory)
    known = {}
    for part in sorted((directory / CHECKSUMS).glob("rank*.json")):
        try:
            known.update(json.loads(part.read_text()))
        except (OSError, ValueError):
            pass  # read again below
    files = {str(p.relative_to(directory)): p for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name not in skip and p.name != MANIFEST and p.parent.name != CHECKSUMS}
    entries, todo = {}, []
    for name, p in files.items():
        size = p.stat().st_size
        k = known.get(name)
        if k is not None and k.get("bytes") == size:
            entries[name] = {"bytes": size, "crc32": k["crc32"]}
        else:
            entries[name] = {"bytes": size}
            todo.append(p)
    for p, c in crc32_of(todo).items():
        entries[str(p.relative_to(directory))]["crc32"] = c
    (directory / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": entries}, indent=0))
    if (directory / CHECKSUMS).is_dir():
        for part in (directory / CHECKSUMS).glob("*"):
            part.unlink()
        (directory / CHECKSUMS).rmdir()


def read_manifest(directory: Path) -> dict[str, dict] | None:
    """name -> {"bytes", "crc32"?} of a checkpoint's manifest (older manifests: sizes only), or
    None without one. Raises ValueError/OSError for a damaged one."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT:
        return data["files"]
    if isinstance(data, dict) and all(isinstance(v, int) for v in data.values()):  # sizes only (ours, older)
        return {k: {"bytes": v} for k, v in data.items()}
    raise ValueError("not a manifest of this framework")


def untrusted(directory: Path) -> str | None:
    """Why loading ``directory`` would unpickle bytes this framework did not vouch for (no
    manifest of ours), or None."""
    try:
        files = read_manifest(directory)
    except (OSError, ValueError):
        files = None
    if files is None:
        return (f"{directory} has no manifest.json of this framework, and torch's checkpoint reader "
                "unpickles its .metadata (a crafted file can run code)")
    return None


def manifest_problem(directory: Path, verify: bool = True) -> str | None:
    """Why ``directory`` is not a complete checkpoint, naming the file; None when it is (or when
    it predates manifests and only its trainer_state.json can be checked). ``verify``: compare
    the crc32 of every file the manifest has one for (a file garbled at the same size)."""
    state = directory / "trainer_state.json"
    if not state.is_file():
        return f"{state} is missing (the save did not finish)"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as e:
        return f"{state} is corrupt ({one_line(e)})"
    path = directory / MANIFEST
    try:
        files = read_manifest(directory)
    except (OSError, ValueError) as e:
        return f"{path} is corrupt ({one_line(e)})"
    if files is None:
        return None
    to_hash = []
    for name, entry in files.items():
        f = directory / name
        if not f.is_file():
            return f"{f} is missing"
        actual = f.stat().st_size
        if actual != entry["bytes"]:
            return f"{f} is truncated or damaged ({actual} bytes, {entry['bytes']} when it was written)"
    return checksum_problem(directory, files) if verify else None


def checksum_problem(directory: Path, files: dict[str, dict], part: tuple[int, int] = (0, 1)) -> str | None:
    """The first file whose crc32 differs from the manifest's, or None. ``part`` (index, count):
    check only every count-th file from index on (the ranks of a load share the reading)."""
    names = sorted(name for name, entry in files.items() if "crc32" in entry)[part[0]::part[1]]
    for f, crc in sorted(crc32_of([directory / n for n in names]).items()):
        want = files[str(f.relative_to(directory))]["crc32"]
        if crc != want:
            return f"{f} is damaged (crc32 {crc}, {want} when it was written)"
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
        if manifest_problem(p, verify=False) is None:
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
