"""The checkpoint folder (``checkpoint.dir``): which complete checkpoints it holds, which one
``checkpoint.load`` names, which ones pruning may delete (only this run's lineage), and whether a
run may write there at all. multimodal/checkpointing.py writes and reads the checkpoints themselves.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from core.errors import CheckpointError, ConfigError, DiskFullError, IncompleteCheckpoint, one_line
from multimodal import checkpoint_checks as checks

log = logging.getLogger("multimodal.checkpointing")  # one logger for the checkpoint lines


def _iteration_of(path: Path) -> int | None:
    try:
        return int(path.name[len("iter_"):])
    except ValueError:
        return None


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(iteration, path) of every complete checkpoint directory in ``root``, by iteration."""
    out = []
    for p in root.glob("iter_*"):
        it = _iteration_of(p)
        if it is not None and p.is_dir() and (p / "trainer_state.json").is_file():
            out.append((it, p))
    return sorted(out)


def prune(root: Path, keep_last: int, newest: Path | None = None, lineage: list | None = None) -> None:
    """Keep the newest ``keep_last`` checkpoints of this run's lineage (by iteration number), and
    always: the one just written, the one ``latest`` names, the newest one whose weights were
    checked finite and the newest one whose loss and grad norm were normal. Checkpoints of other
    runs (another lineage, e.g. left by an earlier run with checkpoint.overwrite=true) and those
    past the one just written (a resume from an earlier checkpoint) are never pruned."""
    if keep_last <= 0:
        return
    mine = set(lineage) if lineage else {None}  # None: checkpoints written without a lineage
    top = _iteration_of(newest) if newest is not None else None
    done = []
    for it, p in _complete_checkpoints(root):
        state = trainer_state(p)
        if state.get("run_id") in mine and (top is None or it <= top):
            done.append((p, state))
    keep = {p for p, _ in done[-keep_last:]}
    keep |= {p for p, _ in [d for d in done if d[1].get("finite")][-1:]}
    keep |= {p for p, _ in [d for d in done if d[1].get("normal", True) and d[1].get("finite")][-1:]}
    if newest is not None:
        keep.add(newest)
    marker = root / "latest"
    if marker.is_file():
        keep.add(root / marker.read_text().strip())
    for old, _ in done:
        if old not in keep:
            shutil.rmtree(old)


def start_run(ckpt_dir: str | None, load_path: Path | None, overwrite: bool = False) -> dict:
    """This run's lineage (its id and its ancestors', stored in each checkpoint's trainer state:
    pruning deletes only checkpoints of the lineage), after checking that ``checkpoint.dir`` holds
    no other run's checkpoints unless the run resumes from it or ``checkpoint.overwrite=true``."""
    run_id = uuid.uuid4().hex[:12]
    ancestors = []
    if load_path is not None:
        state = trainer_state(load_path)
        ancestors = state.get("lineage") or [state.get("run_id")]
    if ckpt_dir:
        root = Path(ckpt_dir)
        existing = _complete_checkpoints(root) if root.is_dir() else []
        inside = load_path is not None and Path(load_path).resolve().parent == root.resolve()
        if existing and not inside:
            names = f"{len(existing)} checkpoint(s), newest {existing[-1][1].name}"
            if not overwrite:
                raise ConfigError(
                    f"checkpoint.dir={ckpt_dir} already holds another run's checkpoints ({names}) and this run "
                    "does not resume from them; resume with checkpoint.load=latest, choose another checkpoint.dir, "
                    "or set checkpoint.overwrite=true to write into it anyway")
            log.warning("checkpoint.overwrite=true: %s holds another run's checkpoints (%s); this run writes "
                        "beside them, replaces those with the same step numbers, never prunes the others, and "
                        "moves 'latest' to its own", ckpt_dir, names)
    return {"run_id": run_id, "lineage": [*ancestors, run_id]}


def check_writable(ckpt_dir: str) -> None:
    """Refuse, before anything is built, a checkpoint.dir this process cannot create or write."""
    root = Path(ckpt_dir)
    probe = root / f".write_probe_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir={ckpt_dir} is not writable ({type(e).__name__}: {one_line(e)}); "
                              "point checkpoint.dir at a writable folder, or set checkpoint.dir=null to "
                              "train without checkpoints") from e


def check_free_space(ckpt_dir: str, need: int, what: str) -> None:
    """Refuse a run whose checkpoint.dir has no room for one checkpoint (``need`` bytes, estimated)."""
    free = checks.free_bytes(ckpt_dir)
    if free is not None and free < need:
        raise DiskFullError(f"checkpoint.dir={ckpt_dir} has {free / 2**20:.1f} MiB free, one checkpoint needs about "
                            f"{need / 2**20:.1f} MiB ({what}); free space there, point checkpoint.dir elsewhere "
                            "or set checkpoint.dir=null")


def trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json ({} when unreadable)."""
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}


def resolve(load: str, ckpt_dir: str | None) -> Path | None:
    """Path of the checkpoint to load, or None when 'latest' finds nothing (fresh start, said in one
    line). An explicit path that is not a complete checkpoint is refused (before anything is built)."""
    if load == "latest":
        marker = Path(ckpt_dir) / "latest"
        if not marker.is_file():
            why = "the folder does not exist" if not Path(ckpt_dir).is_dir() else "it has no 'latest' file"
            log.info("checkpoint.load=latest: no checkpoint in %s (%s); starting from step 0", ckpt_dir, why)
            return None
        path = Path(ckpt_dir) / marker.read_text().strip()
    else:
        path = Path(load)
        if not path.exists():
            raise IncompleteCheckpoint(f"checkpoint.load={load}: no such file or directory; point it at an "
                                  "iter_XXXXXXX directory, a checkpoint.dir, or use checkpoint.load=latest")
        if (path / "latest").is_file():  # a checkpoint.dir was given: take its newest
            path = path / (path / "latest").read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise IncompleteCheckpoint(
            f"{path} is not a complete checkpoint (no trainer_state.json); "
            "point checkpoint.load at an iter_XXXXXXX directory or a checkpoint.dir with a 'latest' file"
        )
    return path
