"""The step clock: wall time of the training loop's log windows, measured without a host sync."""

from __future__ import annotations

import time

import torch


class StepClock:
    """Wall time between log steps without a host sync: on CUDA, events recorded on the stream at
    the end of each log step (their difference is the stream's own timeline, idle gaps included,
    i.e. what the steps really took); on the CPU, where every op is synchronous, the host clock.
    Everything between two marks counts, logging included."""

    def __init__(self, is_cuda: bool):
        self.is_cuda = is_cuda
        self.last = self._now()

    def _now(self):
        if self.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def mark(self):
        """-> (start, end) of the window that ends now."""
        start, self.last = self.last, self._now()
        return start, self.last

    def seconds(self, start, end) -> float:
        if self.is_cuda:
            end.synchronize()  # this window's end only: later steps stay queued
            return start.elapsed_time(end) / 1e3
        return end - start
