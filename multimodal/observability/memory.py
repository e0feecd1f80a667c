"""Memory tools for the training loop: CUDA allocator history snapshots and manual Python GC.

``logging.memory_history=true`` records every CUDA allocation (with its Python/C++ stack) from
before the model is built, writes ``<logging.dir>/memory_snapshot.pickle`` (rank r > 0:
``memory_snapshot_rank{r}.pickle``) after step ``logging.memory_snapshot_step`` and then stops
recording, because keeping the stack of every allocation costs host time on each step. Open
the file at https://pytorch.org/memory_viz or with ``python -m torch.cuda._memory_viz``.
While recording, a CUDA out-of-memory error also writes ``memory_snapshot_oom.pickle``: the
allocator calls our observer once, and the history is already in memory, so it is cheap.

``logging.manual_gc_interval=N`` turns off Python's automatic garbage collector and runs
``gc.collect()`` every N steps instead. Automatic collections start at arbitrary moments on
each rank (whenever allocation counts cross a threshold); one rank pausing for a full
collection stalls every collective the others wait in. Collecting on the same step everywhere
keeps those pauses aligned. The iteration counter is the same on all ranks, so no
communication is needed.
"""

from __future__ import annotations

import gc
import logging
import pickle
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# allocation/free events kept in the ring buffer (the viz tool handles this size fine)
MAX_ENTRIES = 200_000


class MemoryTools:
    def __init__(self, logging_cfg, is_cuda: bool, rank: int = 0):
        self.dir = Path(logging_cfg.dir)
        self.history = bool(logging_cfg.memory_history)
        self.snapshot_step = logging_cfg.memory_snapshot_step
        self.gc_interval = logging_cfg.manual_gc_interval
        self.is_cuda, self.rank = is_cuda, rank
        self.recording = False
        self.gc_was_enabled = gc.isenabled()
        self.snapshot_path: Path | None = None

    def _path(self, tag: str = "") -> Path:
        suffix = f"_rank{self.rank}" if self.rank else ""
        return self.dir / f"memory_snapshot{tag}{suffix}.pickle"

    def start(self) -> "MemoryTools":
        if self.history:
            if not self.is_cuda:
                if self.rank == 0:
                    log.info("logging.memory_history: no CUDA device, nothing to record (the CUDA allocator "
                             "history is GPU-only)")
            else:
                torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
                self.recording = True
                try:  # private API: an OOM snapshot is a bonus, never a reason to fail
                    torch._C._cuda_attach_out_of_memory_observer(self._on_oom)
                except (AttributeError, RuntimeError) as e:
                    log.warning("memory snapshot on OOM unavailable: %s", e)
        if self.gc_interval > 0:
            gc.disable()
            gc.collect()  # start from a clean heap so the first manual collection is not the largest
        return self

    def _on_oom(self, device, alloc, device_alloc, device_free) -> None:
        if not self.recording:
            return
        path = self._path("_oom")
        try:
            self._dump(path)
            log.error("CUDA out of memory (asked %d bytes, %d free): allocator snapshot written to %s",
                      alloc, device_free, path)
        except Exception as e:  # noqa: BLE001 - we are already failing; do not mask the OOM
            log.error("CUDA out of memory; writing the allocator snapshot failed: %s", e)

    def _dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        snapshot = torch.cuda.memory._snapshot()
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)

    def snapshot(self) -> Path | None:
        """Write the snapshot now and stop recording (later allocations are not traced)."""
        if not self.recording:
            return None
        path = self._path()
        self._dump(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        self.snapshot_path = path
        log.info("CUDA allocator snapshot written to %s (open it at https://pytorch.org/memory_viz)", path)
        return path

    def after_step(self, it: int) -> None:
        if self.recording and it >= self.snapshot_step:
            self.snapshot()
        if self.gc_interval > 0 and it % self.gc_interval == 0:
            gc.collect()

    def close(self) -> None:
        """End of training (or failure): a run shorter than the snapshot step still leaves one;
        Python's collector gets its previous state back (in-process callers such as tests)."""
        if self.recording:
            try:
                self.snapshot()
            except Exception as e:  # noqa: BLE001
                log.warning("could not write the allocator snapshot at exit: %s", e)
                torch.cuda.memory._record_memory_history(enabled=None)
                self.recording = False
        if self.gc_interval > 0 and self.gc_was_enabled:
            gc.enable()


def activation_bytes_held(forward, exclude: set[int] = frozenset()):
    """Run ``forward()``; return (its output, the bytes of the distinct storages autograd holds
    for the backward when it returns). Storages whose data_ptr is in ``exclude`` (pass the
    parameters') are not counted, nor those selective recompute has discarded (resized to 0
    bytes by then). This is the step's activation memory, exactly and on any device, without
    the allocator's workspaces and fragmentation that a CUDA peak adds."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    storages = {}
    for t in saved:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
    return out, sum(storages.values())

