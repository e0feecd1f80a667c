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
"""

from __future__ import annotations

import logging
import signal

import torch

from multimodal import checkpointing

log = logging.getLogger(__name__)


class AsyncSaves:
    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

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
        try:
            self.wait()
        finally:
            self.queue.close()
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)
