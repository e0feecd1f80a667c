"""Checkpoints written while training goes on (``checkpoint.async_save``).

A save copies this rank's tensors to host memory (megatron's async torch_dist strategy) and
hands the file writing to a background process; the step loop goes on. What makes the save a
checkpoint (manifest, ``trainer_state.json``, the rename, ``latest``, pruning: ``_commit`` in
multimodal/checkpointing.py) runs only once every rank's files are written, so ``latest`` never
names a checkpoint still being written, and a kill -9 at any moment leaves the previous one.

- At most one save in flight: a save due while the previous one is still being written is
  deferred (one warning) to the first step after that write is done; the end of the run waits.
- ``poll()`` once per step finishes a save whose writes are done (megatron's AsyncCallsQueue: a
  small all-reduce of "done" flags, read on the host: one sync per step, only while a save is
  in flight).
- The end of training, an error and SIGTERM (Slurm's pre-emption signal) wait for the save in
  flight (``wait``); a SIGTERM then ends the run with exit code 143 (multimodal/platform.py).
- The writer process writes each rank's files with several threads (checkpointing.writer_threads)
  and logs its rate in GB/s.
- A full disk in the writer process is reported as on the synchronous path (partial files
  removed, earlier checkpoints intact).
- megatron's writer reports back through a ``multiprocessing`` Manager queue that it starts at the
  first save: a spawned process that imports the entry point's modules (torch, megatron) before
  it answers, seconds during which training waited. It is started in the background when the run
  starts (``_start_results_queue``), and the first save only waits for what is left of that.
- The host copies go into page-locked buffers kept from one save to the next (``PinnedStaging``),
  page-locked in the background during the first steps (``reserve``), so that not even the first
  save pays for it.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import threading
import time

import psutil
import torch

from multimodal import checkpointing

log = logging.getLogger(__name__)


class PinnedStaging:
    """Host copies of a checkpoint's tensors in buffers reused from one save to the next.

    megatron's async writer stages each GPU tensor with ``tensor.to("cpu", non_blocking=True)``:
    new page-locked host tensors at every save, which torch's host allocator serves from the
    blocks an earlier save freed, if their sizes fit. Page-locking is what costs: a first
    staging takes many times longer than a second into blocks already locked, and the first save
    stops training that long (scripts/bench_checkpoint_staging.py, docs/fault_tolerance.md).
    Here each tensor gets a buffer of its own, kept and reused while the checkpoint's layout stays
    the same. ``reserve`` page-locks a pool for the first save in a background
    thread while training runs, so the first save carves its buffers out of memory already
    locked: one chunk per large tensor, the small ones packed into shared chunks. Reuse is safe
    because at most one save is in flight: a new save stages only after the previous writer
    process is done.

    A carved buffer owns a storage of exactly its bytes (``torch.frombuffer`` over the chunk), not
    a view of the chunk's storage: the writer serializes a tensor's whole storage, and views of a
    shared chunk would each write the whole chunk."""

    CHUNK_BYTES = 256 << 20  # one page-locking call: short, so the training thread's CUDA calls interleave
    ALIGN = 256

    def __init__(self, copy_host_tensors: bool = False, chunk_bytes: int | None = None):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.copy_host_tensors = copy_host_tensors  # tests: stage CPU tensors too (no GPU here)
        self.chunk_bytes = chunk_bytes or self.CHUNK_BYTES
        self.pool: list[torch.Tensor] = []  # page-locked uint8 chunks not yet carved up
        self.chunks: list[torch.Tensor] = []  # every chunk carved from (kept while its buffers may be)
        self._reserved = False  # reserve() ran and the first save has not come yet
        self._reserving: threading.Thread | None = None
        self._stop = threading.Event()

    def plan(self, sizes: list[int]) -> list[int]:
        """Chunk sizes for tensors of ``sizes`` bytes: one per tensor larger than a chunk, and
        enough shared chunks for the rest (with room for what packing leaves unused)."""
        large = sorted((n for n in sizes if n > self.chunk_bytes), reverse=True)
        small = sum(-(-n // self.ALIGN) * self.ALIGN for n in sizes if n <= self.chunk_bytes)
        shared = -(-small * 9 // 8 // self.chunk_bytes) + (1 if small else 0)
        return large + [self.chunk_bytes] * shared

    def reserve(self, sizes: list[int], max_bytes: int | None = None) -> None:
        """Page-lock, in the background, the chunks ``plan(sizes)`` names (up to ``max_bytes``)."""
        pin = torch.cuda.is_available()
        device = torch.cuda.current_device() if pin else None
        chunks = self.plan(sizes)
        want = sum(chunks)
        self._reserved = True

        def run():
            if device is not None:  # a new thread starts on GPU 0: stay off other ranks' GPUs
                torch.cuda.set_device(device)
            t0, total = time.perf_counter(), 0
            for n in chunks:
                if self._stop.is_set() or (max_bytes is not None and total + n > max_bytes):
                    break
                self.pool.append(torch.empty(n, dtype=torch.uint8, pin_memory=pin))
                total += n
            log.info("checkpoint staging: %.1f of %.1f GiB of host memory page-locked in the background in "
                     "%.1f s%s", total / 2**30, want / 2**30, time.perf_counter() - t0,
                     " (stopped by the first save)" if self._stop.is_set() else "")

        self._reserving = threading.Thread(target=run, name="pin-checkpoint-staging", daemon=True)
        self._reserving.start()

    def _stop_reserving(self) -> None:
        if self._reserving is not None:
            self._stop.set()
            self._reserving.join()  # finishes the chunk it is locking
            self._reserving = None

    def _carve(self, shape, dtype, cursor: dict) -> torch.Tensor | None:
        """A buffer for one tensor from the pool, or None when the pool has no room for it: the
        smallest free large chunk that holds it, else the next room in the shared chunks.
        ``cursor``: the shared chunk being filled and its next free byte."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes == 0:
            return None
        if nbytes > self.chunk_bytes:
            fits = [c for c in self.pool if c.numel() > self.chunk_bytes and c.numel() >= nbytes]
            if not fits:
                return None
            chunk = min(fits, key=lambda c: c.numel())
            self.pool = [c for c in self.pool if c is not chunk]
            return self._buffer(chunk, 0, nbytes, shape, dtype)
        while True:
            chunk = cursor.get("chunk")
            start = -(-cursor.get("offset", 0) // self.ALIGN) * self.ALIGN
            if chunk is not None and start + nbytes <= chunk.numel():
                cursor["offset"] = start + nbytes
                return self._buffer(chunk, start, nbytes, shape, dtype)
            shared = [c for c in self.pool if c.numel() == self.chunk_bytes]
            if not shared:
                return None
            self.pool = [c for c in self.pool if c is not shared[0]]
            cursor.update(chunk=shared[0], offset=0)

    def _buffer(self, chunk: torch.Tensor, start: int, nbytes: int, shape, dtype) -> torch.Tensor:
        if not any(c is chunk for c in self.chunks):
            self.chunks.append(chunk)
        memory = (ctypes.c_uint8 * chunk.numel()).from_address(chunk.data_ptr())
        return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)

    def __call__(self, write_buckets: list, non_blocking: bool = True) -> list:
        self._stop_reserving()
        pin = torch.cuda.is_available()
        used, staged, cursor, fresh = {}, [], {}, 0
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            tensors = []
            for item, tensor in tensor_data:
                if tensor.device.type == "cpu" and not self.copy_host_tensors:
                    tensors.append((item, tensor))
                    continue
                key = (storage_key, len(tensors), tuple(tensor.shape), tensor.dtype)
                buf = self.buffers.get(key)
                if buf is None:
                    buf = self._carve(tensor.shape, tensor.dtype, cursor)
                if buf is None:
                    buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                    fresh += buf.numel() * buf.element_size()
                buf.copy_(tensor, non_blocking=pin)
                used[key] = buf
                tensors.append((item, buf))
            staged.append((file_name, storage_key, (bytes_data, tensors)))
        if self._reserved:
            log.info("checkpoint staging: %.2f GiB staged into memory page-locked ahead, %.2f GiB locked at the save",
                     (self.nbytes_of(used) - fresh) / 2**30, fresh / 2**30)
        self.pool, self._reserved = [], False  # what the first save did not use is let go
        self.buffers = used  # buffers of a layout no longer saved are let go
        if pin:
            torch.cuda.synchronize()  # the writer process is forked next: the copies must be complete
        return staged

    @staticmethod
    def nbytes_of(buffers: dict) -> int:
        return sum(b.numel() * b.element_size() for b in buffers.values())

    @property
    def nbytes(self) -> int:
        return self.nbytes_of(self.buffers)

    def close(self) -> None:
        self._stop_reserving()
        self.buffers, self.pool, self.chunks = {}, [], []


def checkpoint_tensor_sizes(model, optimizer, device_type: str = "cuda") -> list[int]:
    """About the tensors (their bytes) this rank's checkpoint stages from the GPU: the model's
    weights and buffers, and every inner optimizer's parameters (fp32 main copies) and state
    (moments), each tensor once."""
    seen, sizes = set(), []

    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type == device_type and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            sizes.append(t.numel() * t.element_size())

    for t in model.state_dict().values():
        add(t)
    stack = [optimizer]
    while stack:
        opt = stack.pop()
        stack.extend(getattr(opt, "chained_optimizers", []))
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    add(p)
            for state in inner.state.values():
                for t in state.values():
                    add(t)
    return sizes


class AsyncSaves:
    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        self.staging = PinnedStaging()
        # megatron stages through this static method of its writer (get_save_function_and_args)
        self._megatron_preload = FileSystemWriterAsync.__dict__["preload_tensors"]
        FileSystemWriterAsync.preload_tensors = staticmethod(self.staging)
        self.queue = AsyncCallsQueue()
        self.in_flight = None  # (root, tmp, bytes needed) of the save being written
        self.submitted_at = 0.0  # time.perf_counter() of the save in flight
        self.deferred: int | None = None  # the step whose save waits for the one in flight
        self._results_queue = self._start_results_queue()

    @staticmethod
    def _start_results_queue() -> threading.Thread | None:
        """Start megatron's writer-results queue (its module-level Manager queue) in a thread."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        if fa._results_queue is not None:
            return None

        def run():
            queue = multiprocessing.get_context("spawn").Manager().Queue()  # as fa.get_write_results_queue
            if fa._results_queue is None:
                fa._results_queue = queue

        thread = threading.Thread(target=run, name="checkpoint-results-queue", daemon=True)
        thread.start()
        return thread

    def ready(self) -> None:
        """Called before megatron's save: the results queue exists (else the save would start its own)."""
        if self._results_queue is not None:
            t0 = time.perf_counter()
            self._results_queue.join()
            self._results_queue = None
            if time.perf_counter() - t0 > 0.1:
                log.info("checkpoint: waited %.1f s for the writer's results queue, still starting",
                         time.perf_counter() - t0)

    def reserve_staging(self, model, optimizer) -> None:
        """Page-lock the first save's host buffers in the background (GPU runs; the trainer calls
        it after step 2, when the optimizer's moments exist even with an overlapped update). At
        most half the host memory free now, shared by this node's ranks: past that the save locks
        the rest itself, as before."""
        if not torch.cuda.is_available():
            return
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sizes = checkpoint_tensor_sizes(model, optimizer)
        cap = psutil.virtual_memory().available // (2 * local_ranks)
        if sum(sizes) > cap:
            log.info("checkpoint staging: the first save needs about %.1f GiB of host memory per rank; "
                     "page-locking at most %.1f GiB of it ahead", sum(sizes) / 2**30, cap / 2**30)
        self.staging.reserve(sizes, max_bytes=cap)

    def due(self, it: int, due: bool, final: bool) -> bool:
        """Whether to save at step ``it``: a due save is deferred while the previous one is still
        being written (training goes on instead of waiting for the disk), and made at the first
        step after that write is done. At the last step a due or deferred save runs (``submit`` waits)."""
        if final and (due or self.deferred is not None):
            self.deferred = None
            return True
        if self.in_flight is None:
            run = due or self.deferred is not None
            if self.deferred is not None:
                log.info("checkpoint due at step %d: saved at step %d, once the previous save was written",
                         self.deferred, it)
            self.deferred = None
            return run
        if due and self.deferred is None:
            self.deferred = it
            log.warning("checkpoint due at step %d deferred: the previous save (%s) is still being written "
                        "(%.1f s so far); it is saved at the first step after that write is done (a larger "
                        "checkpoint.interval avoids this)", it, self.in_flight[1].name[:-4],
                        time.perf_counter() - self.submitted_at)
        return False

    def submit(self, request, commit, root, tmp, need) -> None:
        if self.in_flight is not None:  # at most one save in flight
            t0 = time.perf_counter()
            self.wait()
            log.info("checkpoint %s waited %.1f s for the previous save to be written", tmp.name[:-4],
                     time.perf_counter() - t0)
        request.add_finalize_fn(commit)
        if torch.cuda.is_available():
            self.queue.schedule_async_request(request)
        else:  # CPU runs: megatron's caller synchronizes CUDA before forking the writer; nothing to wait for
            real, torch.cuda.synchronize = torch.cuda.synchronize, lambda *args, **kwargs: None
            try:
                self.queue.schedule_async_request(request)
            finally:
                torch.cuda.synchronize = real
        self.in_flight = (root, tmp, need)
        self.submitted_at = time.perf_counter()

    def poll(self) -> None:
        """Finish the save in flight if every rank's writes are done; never blocks."""
        if self.in_flight is not None:
            self._finalize(blocking=False)

    def wait(self) -> None:
        if self.in_flight is not None:
            self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        root, tmp, need = self.in_flight
        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as e:  # torch's CheckpointException derives from BaseException
            self.in_flight = None
            error = checkpointing.disk_full_or(e, root, tmp, need)
            if error is e:
                raise
            raise error from e
        if self.queue.get_num_unfinalized_calls() == 0:
            self.in_flight = None

    def close(self) -> None:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        try:
            self.wait()
        finally:
            FileSystemWriterAsync.preload_tensors = self._megatron_preload
            self.staging.close()
            self.queue.close()
