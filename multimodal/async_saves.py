"""Checkpoints written while training goes on (``checkpoint.async_save``).

A save copies this rank's tensors to host memory (megatron's async torch_dist strategy) and
hands the file writing to a background process; the step loop goes on. What makes the save a
checkpoint (manifest, ``trainer_state.json``, the rename, ``latest``, pruning: ``_commit`` in
multimodal/checkpointing.py) runs only once every rank's files are written, so ``latest`` never
names a checkpoint still being written, and a kill -9 at any moment leaves the previous one.

- At most one save in flight: a new save first waits for the previous one.
- ``poll()`` once per step finishes a save whose writes are done (megatron's AsyncCallsQueue: a
  small all-reduce of "done" flags, read on the host: one sync per step, only while a save is
  in flight).
- The end of training, an error and SIGTERM (Slurm's pre-emption signal) wait for the save in
  flight (``wait``); a SIGTERM then ends the run with exit code 143.
- A full disk in the writer process is reported as on the synchronous path (partial files
  removed, earlier checkpoints intact).
- The host copies go into page-locked buffers kept from one save to the next (``PinnedStaging``).
"""

from __future__ import annotations

import logging
import signal

import torch

from multimodal import checkpointing

log = logging.getLogger(__name__)


class PinnedStaging:
    """Host copies of a checkpoint's tensors in buffers reused from one save to the next.

    megatron's async writer stages each GPU tensor with ``tensor.to("cpu", non_blocking=True)``:
    new page-locked host tensors at every save, which torch's host allocator serves from the
    blocks an earlier save freed, if their sizes fit. Page-locking is what costs: on an H200,
    29 GiB staged that way took 32.9 s the first time and 0.57 s the second
    (scripts/bench_checkpoint_staging.py); the 2B recipe's first save stopped training 27.3 s.
    Here each tensor gets a buffer of its own, allocated at the first save and reused while the
    checkpoint's layout stays the same (0.57 s, 55 GB/s), whatever the allocator's cache holds;
    allocating them before the first save is what is left. Reuse is safe because at most one
    save is in flight: a new save stages only after the previous writer process is done."""

    def __init__(self, copy_host_tensors: bool = False):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.copy_host_tensors = copy_host_tensors  # tests: stage CPU tensors too (no GPU here)

    def __call__(self, write_buckets: list, non_blocking: bool = True) -> list:
        pin = torch.cuda.is_available()
        used, staged = {}, []
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            tensors = []
            for item, tensor in tensor_data:
                if tensor.device.type == "cpu" and not self.copy_host_tensors:
                    tensors.append((item, tensor))
                    continue
                key = (storage_key, len(tensors), tuple(tensor.shape), tensor.dtype)
                buf = self.buffers.get(key)
                if buf is None:
                    buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                buf.copy_(tensor, non_blocking=pin)
                used[key] = buf
                tensors.append((item, buf))
            staged.append((file_name, storage_key, (bytes_data, tensors)))
        self.buffers = used  # buffers of a layout no longer saved are let go
        if pin:
            torch.cuda.synchronize()  # the writer process is forked next: the copies must be complete
        return staged

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


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
        self.terminated = False
        self._previous_handler = None

    def submit(self, request, commit, root, tmp, need) -> None:
        self.wait()  # at most one save in flight
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

    # ------------------------------------------------------------------ SIGTERM

    def on_sigterm(self) -> None:
        """SIGTERM only sets a flag: the loop checks it between steps and waits for the save."""
        def handler(signum, frame):
            self.terminated = True
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread (tests driving the loop from a thread)
            self._previous_handler = None

    def close(self) -> None:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        try:
            self.wait()
        finally:
            FileSystemWriterAsync.preload_tensors = self._megatron_preload
            self.staging.buffers = {}
            self.queue.close()
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)
