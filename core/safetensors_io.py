"""Safetensors folders read one tensor at a time and written shard by shard.

A Hugging Face checkpoint is a folder of ``model-0000K-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` (or one ``model.safetensors``). ``SafetensorsFolder`` opens the
files lazily (memory-mapped by safetensors) and reads a tensor only when asked, so what a
converter holds is what it is working on, never the checkpoint. ``write_shards`` writes shards
from a plan made before any data exists, so the file names can carry the shard count.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def is_safetensors_folder(path: str | Path) -> bool:
    d = Path(path)
    return d.is_dir() and ((d / INDEX_FILE).is_file() or (d / SINGLE_FILE).is_file())


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's header: name -> {dtype, shape, data_offsets} (offsets from the data start)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["start"] = 8 + size + entry["data_offsets"][0]
    return header


class SafetensorsFolder:
    """Names, shapes and dtypes of every tensor of a folder, and each tensor (or a box of its rows
    and columns, ``read_rows``) on demand, read with ``os.pread``: no memory map, so what the reader
    holds is the tensors it returned and nothing of the files it has read, and ``bytes_read`` (per
    tensor) is exactly what came off the disk. Safe to share between threads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            file_of: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE_FILE).is_file():
            file_of = None
        else:
            raise FileNotFoundError(f"{self.path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
        files = sorted(set(file_of.values())) if file_of else [SINGLE_FILE]
        missing = [f for f in files if not (self.path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{self.path}: {INDEX_FILE} names {len(missing)} missing file(s), e.g. {missing[0]}")
        self._entry: dict[str, dict] = {}
        self.file_of: dict[str, str] = {}
        for f in files:
            for name, entry in read_header(self.path / f).items():
                self._entry[name], self.file_of[name] = entry, f
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return list(self.file_of)

    @property
    def files(self) -> list[str]:
        return sorted(set(self.file_of.values()))

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(self.path / file, os.O_RDONLY)
            return self._fds[file]

    def _info(self, name: str) -> dict:
        try:
            return self._entry[name]
        except KeyError:
            raise KeyError(f"{self.path} holds no tensor {name}") from None

    def _pread(self, name: str, into: memoryview, start: int) -> None:
        fd, done = self._fd(self.file_of[name]), 0
        while done < len(into):
            n = os.preadv(fd, [into[done:]], start + done)
            if n <= 0:
                raise OSError(f"{self.path / self.file_of[name]}: ends inside tensor {name}")
            done += n

    def _count(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_read[name] = self.bytes_read.get(name, 0) + nbytes

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor."""
        e = self._info(name)
        buf = bytearray(e["data_offsets"][1] - e["data_offsets"][0])
        self._pread(name, memoryview(buf), e["start"])
        self._count(name, len(buf))
        if not buf:
            return torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]])
        return torch.frombuffer(buf, dtype=_DTYPES[e["dtype"]]).reshape(e["shape"])

    def read_rows(self, name: str, width: int, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Rows ``rows`` and columns ``cols`` of the tensor seen as a [numel / width, width] matrix
        (its storage order), as a [rows, cols] tensor; only those bytes are read: one read when the
        columns are whole, else one per row."""
        e = self._info(name)
        dtype = _DTYPES[e["dtype"]]
        numel = (e["data_offsets"][1] - e["data_offsets"][0]) // dtype.itemsize
        if width <= 0 or numel % width or not (0 <= rows[0] <= rows[1] <= numel // width) \
                or not (0 <= cols[0] <= cols[1] <= width):
            raise ValueError(f"{name}: rows {rows} x cols {cols} is not inside its {numel // max(width, 1)} x {width} "
                             f"view ({numel} elements)")
        n_rows, n_cols, item = rows[1] - rows[0], cols[1] - cols[0], dtype.itemsize
        buf = bytearray(n_rows * n_cols * item)
        view = memoryview(buf)
        if n_cols == width:
            self._pread(name, view, e["start"] + rows[0] * width * item)
        else:
            span = n_cols * item
            for i in range(n_rows):
                self._pread(name, view[i * span:(i + 1) * span], e["start"] + ((rows[0] + i) * width + cols[0]) * item)
        self._count(name, len(buf))
        if not buf:
            return torch.empty((n_rows, n_cols), dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(n_rows, n_cols)

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._info(name)["dtype"]]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def bytes_on_disk(self) -> int:
        return sum((self.path / f).stat().st_size for f in self.files)

    def largest_file(self) -> int:
        return max((self.path / f).stat().st_size for f in self.files)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def plan_shards(units: Iterable[tuple[object, int]], max_bytes: int) -> list[list[object]]:
    """Group units (in order, each with its byte count) into shards of at most ``max_bytes``;
    a unit is never split, and one larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[object]] = []
    size = 0
    for unit, nbytes in units:
        if not shards or (size + nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += nbytes
    return shards


def shard_name(k: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


class ShardFile:
    """A safetensors file written tensor by tensor: the header (every name, dtype and shape, known
    from a plan) first, then each tensor's bytes at its offset whenever it is ready, in any order.
    Nothing but the tensor being written is held."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        names = {v: k for k, v in _DTYPES.items()}
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        self._span: dict[str, tuple[int, int]] = {}
        pos = 0
        for name, dtype, shape in entries:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self._span[name] = (pos, nbytes)
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._base = 8 + len(raw)
        self.path, self.size = path, self._base + pos
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, len(raw).to_bytes(8, "little") + raw, 0)
        os.ftruncate(self._fd, self.size)
        self._left = set(self._span)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        start, nbytes = self._span[name]
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise ValueError(f"{self.path.name}: {name} has {data.nbytes} bytes, the header says {nbytes}")
        view, done = memoryview(data), 0
        while done < nbytes:
            done += os.pwrite(self._fd, view[done:], self._base + start + done)
        self._left.discard(name)

    def close(self) -> int:
        os.close(self._fd)
        os.chmod(self.path, 0o644)
        if self._left:
            raise ValueError(f"{self.path.name}: {len(self._left)} planned tensor(s) never written, e.g. {min(self._left)}")
        return self.size


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """One shard, readable by everyone (0644); returns its size in bytes."""
    from safetensors.torch import save_file

    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)
    return path.stat().st_size


def write_index(out: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    if set(weight_map.values()) == {SINGLE_FILE}:
        return
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    os.chmod(out / INDEX_FILE, 0o644)


def parse_size(text: str | int) -> int:
    """'5GB', '500MiB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for suffix, scale in units.items():
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * scale)
    return int(float(s))


def return_freed_memory() -> None:
    """Make glibc hand buffers of 128 KiB and more back to the OS when they are freed. By default its
    threshold rises to the largest buffer freed so far, after which tensors of that size come from
    the heap, whose freed space the process keeps: a conversion that holds one tensor at a time
    would still grow with the number of tensors it has made."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 128 << 10)  # glibc's initial value, kept fixed
        libc.mallopt(m_trim_threshold, 128 << 10)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def run_parallel(jobs: list[Callable[[], object]], workers: int) -> list[object]:
    """Run ``jobs`` on ``workers`` threads (torch and safetensors release the GIL while copying);
    the first failure is raised after the others stop being started."""
    if workers <= 1 or len(jobs) <= 1:
        return [job() for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
