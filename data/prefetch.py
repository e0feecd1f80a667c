"""Build the next micro-batches in a background thread while the GPU works on this one.

The loader (decode, resize, tokenise, pack) otherwise runs on the training thread, and the
part of it after the optimizer step's host sync sits on the critical path. The thread
produces ``(batch, loader_state_after_batch)`` pairs into a bounded queue, so
``state_dict()`` always describes what the *trainer consumed*, never what was prefetched:
a checkpoint resumes exactly where training stopped. An exception in the thread is raised
in the trainer on the next ``next()``. On CUDA, tensors are pinned so host-to-device copies
can be asynchronous. ``prepare(batch)``, when given, runs on each batch in the thread first (the
model family's host work, ``ModelFamily.prepare_host_batch``). ``wait_s`` counts the seconds the trainer waited for a batch the thread had
not finished: the log's ``data_wait_s`` (a loader that does not keep ahead of the GPU shows there,
not as slower kernels).
"""

from __future__ import annotations

import queue
import threading
import time

import torch


class Prefetcher:
    def __init__(self, iterator, depth: int = 2, pin_memory: bool | None = None, prepare=None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.iterator = iterator
        self.prepare = prepare
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._state = iterator.state_dict()
        self.wait_s = 0.0  # host seconds the trainer spent waiting on an empty queue
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                batch = next(self.iterator)
                if self.prepare is not None:
                    self.prepare(batch)
                if self.pin:
                    batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
                item = (batch, self.iterator.state_dict(), None)
            except BaseException as e:  # handed to the trainer, which raises it
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            batch, state, error = self._queue.get_nowait()
        except queue.Empty:
            start = time.perf_counter()
            batch, state, error = self._queue.get()
            self.wait_s += time.perf_counter() - start
        if error is not None:
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict:
        """The underlying loader's state after the last batch handed to the trainer."""
        return dict(self._state)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
