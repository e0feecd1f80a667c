"""Infinite, resumable, data-parallel micro-batch iterator.

Rank r of a dp group reads global sample indices r, r+dp, r+2dp, ... (wrapping around the
dataset), so ranks never see the same sample and no sampler state needs to be shared. The
only state is the global index of the next unconsumed sample; since samples are pure
functions of their index and packing is greedy in shard order, restoring that one number
reproduces exactly the batches an uninterrupted run would have produced.
"""

from __future__ import annotations

import collections
import itertools
import os

import torch

from data.collate import pack_thd, pad_bshd, padded_length
from core.errors import DataError  # (a leaf module: imports nothing of the project)
# where the scripts and tests have always imported them from; data/registry.py owns them
from data.registry import build_dataset, load_tokenizer  # noqa: F401

MIN_SAMPLES_FOR_BAD_CHECK = 20  # judge the bad-row fraction only once it means something


def default_num_workers(is_cuda: bool, local_world_size: int | None = None) -> int:
    """``data.loader.num_workers: null``: on a GPU, up to 4 decode processes per rank, with two of the
    rank's cores left to its training thread and prefetch thread; none on a CPU, where workers
    would take the cores the model runs on. Why on a GPU: with varied images, decoding in the
    training process leaves the GPU waiting for batches for much of the step
    (docs/performance.md)."""
    if not is_cuda:
        return 0
    ranks = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(4, cores // max(ranks, 1) - 2))


class _IndexedRows(torch.utils.data.Dataset):
    """Worker-side view of the dataset: row i -> (i, sample or None, why it was skipped).

    Skip counters of a dataset copy in a worker process are invisible to the trainer, so the
    reason travels back with the row and is counted in the main process."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index: int):
        counter = getattr(self.dataset, "skipped", None)
        before = collections.Counter(counter) if counter is not None else None
        sample = self.dataset[index % len(self.dataset)]
        reason = None
        if sample is None and counter is not None:
            grown = counter - before
            reason = next(iter(grown), None)
        return index, sample, reason


class _StridedIndices(torch.utils.data.Sampler):
    """start, start+step, ... forever (unwrapped indices; the dataset view wraps them)."""

    def __init__(self, start: int, step: int):
        self.start, self.step = start, step

    def __iter__(self):
        return itertools.count(self.start, self.step)


def _unbatched(rows):
    return rows


class MicroBatchIterator:
    """Yields collated micro-batches forever.

    pack=True: one THD row per micro-batch. With ``pack_lookahead`` = 0, greedily filled with the
    rank's next samples while they fit in ``seq_length``; a sample that does not fit opens the
    next row. With ``pack_lookahead`` = L > 0, the row starts with the oldest of the next L
    samples (so none waits for ever) and is then filled best-fit: each time the largest of the L
    buffered samples that still fits, the buffer refilled in order after each take. Rows then
    carry fewer pad tokens (the 2B recipe's mock rows: 89% real tokens in order, see
    ``pack_fill`` in scripts/bench_loader.py). pack=False: ``micro_batch_size`` samples per BSHD
    micro-batch.
    ``start_index`` is where the whole dp group starts in the global sample order (rank r
    begins at start_index + r); to resume, use ``load_state_dict`` instead.

    ``one_pass=True`` (validation): samples are read once, up to the dataset's end, never wrapped
    around; once a rank has none left its micro-batches are blank rows (``blank_sample``: one pad
    token, no image, no supervised token). Every rank still yields one micro-batch per call, so
    the fixed schedule of micro-batches (and the collectives inside it) runs unchanged, and the
    blank rows add nothing to the loss or its token count.
    """

    def __init__(self, dataset, seq_length: int, pad_id: int, image_token_id: int | tuple[int, ...], merge: int,
                 pack: bool, micro_batch_size: int, dp_rank: int, dp_size: int, start_index: int = 0,
                 max_bad_fraction: float = 0.1, num_workers: int = 0, pad_multiple: int = 1,
                 pack_lookahead: int = 0, one_pass: bool = False):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_size={dp_size})")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        if pack and micro_batch_size != 1:
            raise ValueError("pack=True builds one packed row per micro-batch; use micro_batch_size=1")
        self.dataset, self.seq_length, self.pad_id = dataset, seq_length, pad_id
        self.image_token_id, self.merge = image_token_id, merge
        self.pack, self.micro_batch_size = pack, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._next = start_index + dp_rank  # unwrapped global index of the next unconsumed sample
        self._peeked: tuple[int, dict] | None = None  # cache of the sample at self._next
        self.max_bad_fraction = max_bad_fraction
        self.seen = self.bad = 0  # rows read / rows the dataset skipped, on this rank
        # num_workers > 0: rows are decoded in worker processes, in order, ahead of use; the
        # resumable state is still the next *consumed* index, so prefetched rows are not lost.
        self.num_workers = num_workers
        self.pad_multiple = pad_multiple  # packed samples are padded to multiples of it (CP/SP)
        self._rows = None  # iterator of (index, sample, skip reason) from the workers
        if pack_lookahead < 0:
            raise ValueError(f"pack_lookahead must be >= 0, got {pack_lookahead}")
        self.lookahead = pack_lookahead if pack else 0
        self._buffer: list[tuple[int, dict, int]] = []  # (index, sample, packed length), oldest first
        self.one_pass = one_pass
        self.blank_rows = 0  # micro-batches that held no sample (one_pass, after the dataset's end)
        self._blank: dict | None = None
        self._first: dict | None = None  # one_pass: the first usable sample read, the blank's template

    @classmethod
    def from_config(cls, dataset, model, data, train, dp_rank: int = 0, dp_size: int = 1, *,
                    pad_multiple: int | None = None, one_pass: bool = False) -> MicroBatchIterator:
        """The iterator a recipe describes, from its sections: row length and micro-batch size from
        ``train``, the pad id, placeholder ids and merge size from ``model``, packing, look-ahead,
        decode workers and bad-row limit from ``data``. ``pad_multiple``: what the parallel layout
        needs (the trainer's ``sequence_pad_multiple``); None: ``data.loader.pad_multiple``, or 1."""
        return cls(dataset, train.seq_length, model.pad_token_id, model.vision_token_ids,
                   model.vision.spatial_merge_size, data.pack, train.micro_batch_size, dp_rank, dp_size,
                   max_bad_fraction=data.loader.max_bad_fraction, num_workers=data.loader.num_workers or 0,
                   pad_multiple=pad_multiple or data.loader.pad_multiple or 1,
                   pack_lookahead=data.loader.pack_lookahead,
                   one_pass=one_pass)

    def _read(self, index: int) -> dict | None:
        if not self.num_workers:
            return self.dataset[index % len(self.dataset)]
        if self._rows is None:
            loader = torch.utils.data.DataLoader(
                _IndexedRows(self.dataset), sampler=_StridedIndices(index, self.dp_size), batch_size=None,
                num_workers=self.num_workers, collate_fn=_unbatched, prefetch_factor=4, persistent_workers=False,
            )
            self._rows = iter(loader)
        got, sample, reason = next(self._rows)
        if got != index:  # cannot happen unless the sampler and the consumer disagree
            raise RuntimeError(f"data worker returned row {got}, expected {index}")
        if sample is None and reason is not None and hasattr(self.dataset, "skipped"):
            self.dataset.skipped[reason] += 1
        return sample

    def __iter__(self):
        return self

    def _peek(self) -> dict | None:
        """The next usable sample of this rank (None: the pass is over, ``one_pass`` only). Rows the
        dataset skips (it returns None for a corrupt image, bad JSON, ...) are stepped over and
        counted; a run whose data is mostly broken stops with the dataset's reasons instead of
        training on what is left."""
        while self._peeked is None or self._peeked[0] != self._next:
            if self.one_pass and self._next >= len(self.dataset):
                return None
            sample = self._read(self._next)
            self.seen += 1
            if sample is not None:
                self._peeked = (self._next, sample)
                if self.one_pass and self._first is None:
                    self._first = sample
                break
            self.bad += 1
            if self.seen >= MIN_SAMPLES_FOR_BAD_CHECK and self.bad > self.max_bad_fraction * self.seen:
                reasons = dict(getattr(self.dataset, "skipped", {}))
                raise DataError(
                    f"{self.bad} of {self.seen} samples read by data-parallel rank {self.dp_rank} were unusable "
                    f"({reasons}), more than data.loader.max_bad_fraction={self.max_bad_fraction}; fix the data or "
                    "raise data.loader.max_bad_fraction")
            self._next += self.dp_size
        return self._peeked[1]

    def _take(self) -> dict | None:
        sample = self._peek()
        if sample is not None:
            self._next += self.dp_size
        return sample

    def blank_sample(self) -> dict:
        """A sample that occupies a row and is scored on nothing: one pad token, no image, loss
        mask 0. Its position-id and pixel layouts are copied from the dataset's first usable
        sample, so it collates like the dataset's own samples for any model family."""
        if self._blank is None:
            like = self._first or next((s for s in map(self.dataset.__getitem__, range(len(self.dataset)))
                                        if s is not None), None)
            if like is None:
                raise DataError("the dataset has no usable sample (every one was skipped); fix the data")
            self._blank = {
                "input_ids": torch.full((1,), self.pad_id, dtype=torch.long),
                "labels": torch.full((1,), -100, dtype=torch.long),
                "loss_mask": torch.zeros(1),
                "position_ids": torch.zeros_like(like["position_ids"][..., :1]),
                "pixel_values": like["pixel_values"][:0],
                "image_grid_thw": like["image_grid_thw"][:0],
                "index": -1,
            }
        self.blank_rows += 1
        return self._blank

    def _size(self, sample: dict) -> int:
        return padded_length(len(sample["input_ids"]), self.pad_multiple)

    def _refill(self) -> None:
        while len(self._buffer) < self.lookahead:
            sample = self._peek()
            if sample is None:
                return
            self._buffer.append((self._next, sample, self._size(sample)))
            self._take()

    def _best_fit_row(self) -> list[dict]:
        self._refill()
        if not self._buffer:
            return [self.blank_sample()]
        _, first, used = self._buffer.pop(0)  # the oldest: every sample gets its turn
        row = [first]
        while True:
            self._refill()
            space = self.seq_length - used
            fits = [j for j, (_, _, n) in enumerate(self._buffer) if n <= space]
            if not fits:
                return row
            j = max(fits, key=lambda j: self._buffer[j][2])  # the largest; the oldest among equals
            _, sample, n = self._buffer.pop(j)
            row.append(sample)
            used += n

    def __next__(self) -> dict:
        args = (self.seq_length, self.pad_id, self.image_token_id, self.merge)
        if not self.pack:
            samples = [self._take() for _ in range(self.micro_batch_size)]
            return pad_bshd([s if s is not None else self.blank_sample() for s in samples], *args)

        if self.lookahead or self._buffer:  # (a buffer restored into a run without lookahead drains first)
            return pack_thd(self._best_fit_row(), *args, pad_multiple=self.pad_multiple)
        row = [self._take() or self.blank_sample()]  # at least one sample; pack_thd raises if it is too long
        used = self._size(row[0])
        while (nxt := self._peek()) is not None and used + self._size(nxt) <= self.seq_length:
            used += self._size(nxt)
            row.append(self._take())
        return pack_thd(row, *args, pad_multiple=self.pad_multiple)

    def summary(self) -> dict:
        """Rows read and skipped on this rank, with the dataset's skip reasons (for the logs)."""
        reasons = dict(getattr(self.dataset, "skipped", {}) or {})
        return {"rows_read": self.seen, "rows_skipped": self.bad, "skipped_by_reason": reasons}

    def state_dict(self) -> dict:
        """The global (unwrapped, so epochs are visible) index of this rank's next unread sample,
        and the indices read ahead but not yet packed (``pack_lookahead``)."""
        return {"next_index": self._next, "pending": [i for i, _, _ in self._buffer]}

    def load_state_dict(self, sd: dict) -> None:
        nxt = int(sd["next_index"])
        if nxt < 0:
            raise ValueError(f"data loader state next_index={nxt} must be >= 0")
        self._next, self._peeked = nxt, None
        self._rows = None  # workers restart at the restored index
        # read-ahead samples are read again here, in this process (the workers start at next_index);
        # a state from a run without lookahead has none, one from a run with it resumes its buffer
        self._buffer = []
        for i in sd.get("pending", []):
            sample = self.dataset[int(i) % len(self.dataset)]
            if sample is not None:
                self._buffer.append((int(i), sample, self._size(sample)))
