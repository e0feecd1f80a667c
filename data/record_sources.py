"""Where conversation records come from: one record by index, without reading the whole set.

``open_records(path)`` accepts
- a ``.jsonl`` file: start-up records each line's byte offset (8 bytes a record), a record reads
  its one line;
- a ``.json`` file holding a list of records (parsed whole: fine for thousands, use JSONL beyond);
- a folder written by Hugging Face ``datasets`` (``Dataset.save_to_disk``: ``state.json`` and
  ``data-*.arrow`` files in Arrow's streaming format), or any folder of ``.arrow`` files: each is
  memory-mapped, so a record costs its own bytes only;
- a folder of ``.parquet`` files (``Dataset.to_parquet``, the Hub's parquet exports): a record
  decodes its row group, and the last few row groups are kept;
- a folder of ``.jsonl`` / ``.json`` files, read as above, one after the other in name order.

A ``DatasetDict`` folder (``dataset_dict.json`` and one folder per split) is refused with the
splits named: point the path at one of them. Records are the dicts ``datasets`` would give
(``Image`` features as ``{"bytes": ..., "path": ...}``).
"""

from __future__ import annotations

import bisect
import collections
import json
from pathlib import Path

import numpy as np

from core.errors import DataError
from data.cord_v2 import SkipSample


class RecordSourceError(DataError, ValueError):
    """The path holds no records this module can read; the message names the fix (one line, exit code 2)."""


def line_offsets(path: Path) -> np.ndarray:
    """Byte offset of every non-blank line of a JSONL file (one buffered pass, 8 bytes a line)."""
    from array import array

    offsets, pos = array("q"), 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return np.frombuffer(offsets, dtype=np.int64) if offsets else np.zeros(0, dtype=np.int64)


def _locate(starts: np.ndarray, index: int) -> tuple[int, int]:
    """(part, row within it) of ``index`` over parts whose first rows are ``starts`` (cumulative)."""
    k = bisect.bisect_right(starts, index) - 1
    return k, index - int(starts[k])


class JsonlRecords:
    def __init__(self, path: Path):
        self.path, self.offsets = path, line_offsets(path)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int):
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[index]))
            line = f.readline()
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:  # json.loads would raise it past the bad-row count
            raise SkipSample("bad_text", f"line is not UTF-8 (byte {line[e.start]:#04x} at offset {e.start})") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise SkipSample("bad_json", f"line is not valid JSON ({e})") from None


class JsonListRecords:
    def __init__(self, path: Path):
        raw = path.read_bytes()
        try:
            self.records = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:  # one file is one unit here: it cannot be skipped row by row
            raise RecordSourceError(f"{path} is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); re-save it "
                                    "as UTF-8, or as JSONL, where a bad line is skipped and counted") from None
        except json.JSONDecodeError as e:
            raise RecordSourceError(f"{path} is not valid JSON ({e}); fix it, or write JSONL, where a bad line is "
                                    "skipped and counted") from None
        if not isinstance(self.records, list):
            raise RecordSourceError(f"{path} must hold a JSON list of records (or use a .jsonl file, one record a line)")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        return self.records[index]


class ArrowRecords:
    """Memory-mapped Arrow files (streaming format, as ``save_to_disk`` writes; file format too)."""

    def __init__(self, files: list[Path]):
        import pyarrow as pa

        self.tables = []
        for f in files:
            source = pa.memory_map(str(f))
            try:
                self.tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:
                self.tables.append(pa.ipc.open_file(pa.memory_map(str(f))).read_all())
        self.starts = np.cumsum([0] + [t.num_rows for t in self.tables])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int):
        k, row = _locate(self.starts, index)
        return self.tables[k].slice(row, 1).to_pylist()[0]


class ParquetRecords:
    """Parquet files; a record decodes its row group (the ``KEEP`` most recent ones are kept)."""

    KEEP = 4

    def __init__(self, files: list[Path]):
        import pyarrow.parquet as pq

        self.files = [pq.ParquetFile(str(f)) for f in files]
        self.groups = [(i, g) for i, f in enumerate(self.files) for g in range(f.num_row_groups)]
        rows = [self.files[i].metadata.row_group(g).num_rows for i, g in self.groups]
        self.starts = np.cumsum([0] + rows)
        self.cache: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int):
        k, row = _locate(self.starts, index)
        table = self.cache.get(k)
        if table is None:
            i, g = self.groups[k]
            table = self.cache[k] = self.files[i].read_row_group(g)
            if len(self.cache) > self.KEEP:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(k)
        return table.slice(row, 1).to_pylist()[0]


class ChainedRecords:
    def __init__(self, parts: list):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int):
        k, row = _locate(self.starts, index)
        return self.parts[k][row]


def open_records(path: str | Path):
    """The records at ``path`` (see the module docstring), indexable and sized."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".jsonl":
            return JsonlRecords(path)
        if path.suffix == ".json":
            return JsonListRecords(path)
        raise RecordSourceError(f"{path}: conversations are read from .json / .jsonl files or a datasets folder")
    if not path.is_dir():
        raise RecordSourceError(f"{path} does not exist")
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise RecordSourceError(f"{path} is a DatasetDict; point at one split: {', '.join(str(path / s) for s in splits)}")
    for suffix, kind in ((".arrow", ArrowRecords), (".parquet", ParquetRecords)):
        files = sorted(path.glob(f"*{suffix}"))
        if files:
            return kind(files)
    files = sorted(f for f in path.iterdir() if f.suffix in (".jsonl", ".json") and f.name not in ("state.json",
                                                                                                  "dataset_info.json"))
    if files:
        return ChainedRecords([open_records(f) for f in files])
    raise RecordSourceError(f"{path} holds no .arrow, .parquet, .jsonl or .json files of conversations")
