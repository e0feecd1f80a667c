"""Hugging Face safetensors <-> our dist-checkpoint, streamed in bounded memory.

Nothing here holds the model. The model is built on the meta device (shapes only) to learn
what megatron's dist-checkpoint stores for it: every chunk's key, global shape and offset, and
which piece of which of our (TP=1) tensors it is (a chunk of a factory such as GDN's split
``in_proj`` is a view of its parameter; its size, strides and storage offset say which).

- import: torch's distributed-checkpoint writer asks the planner for each chunk as it writes it
  (``_StreamingPlanner.resolve_data``); the chunk is made then from the rows of the HF tensors it
  is made of (``_read_region``, as direct loading reads a rank's pieces), and dropped once
  written. Stacked expert weights are written in groups of experts, so the largest thing held is
  one group. ``workers`` threads write files in parallel.
- export: the HF shards are planned from the meta model first (names, sizes, so the file names
  carry the shard count); each shard then reads the units it holds (a decoder layer's tensors, a
  group of its experts, the vision tower, ...) from the dist-checkpoint, only the stored chunks
  they overlap, converts and writes them, and lets them go.

Peak memory is a unit or a shard per worker, whatever the depth of the model.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from core.safetensors_io import (SafetensorsFolder, ShardFile, plan_shards, run_parallel, shard_name, write_index,
                                 write_shard)

log = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "model_config.json"
HF_CONFIG_FILE = "hf_config.json"
# experts stacked per chunk on import: bounds the largest tensor held (a 512-expert layer of the
# 397B model is ~8.6 GB of bf16 per weight; a group of 32 is ~0.5 GB)
EXPERT_GROUP = 32


@dataclass
class Chunk:
    """One stored tensor chunk of our dist-checkpoint and where it lives in our (TP=1) tensor."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    param: str
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset in the param
    experts: tuple[int, int] | None = None  # (lo, hi) of a stacked expert weight


def init_single_process() -> None:
    """One gloo process with every parallel size 1 and seeded RNG streams: what building a model
    (even on the meta device) needs outside the trainer."""
    from megatron.core import parallel_state as ps

    from core.safetensors_io import return_freed_memory
    from core.seeding import seed_everything
    from multimodal.platform import init_distributed

    return_freed_memory()
    init_distributed()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    seed_everything(0)


def meta_model(m, family):
    """Our model on the meta device at TP=PP=EP=1: shapes and checkpoint layout, no memory."""
    from models.common.parallel_config import ParallelConfig

    with torch.device("meta"):
        return family.build(m, ParallelConfig(), torch.float32)


def chunk_plan(model, expert_group: int = EXPERT_GROUP) -> tuple[list[Chunk], list]:
    """Every chunk megatron would store for ``model`` (TP=1), and its ShardedObjects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import extract_sharded_base

    from models.common.layout_init import pieces_of

    params = dict(model.named_parameters())
    sharded = model.sharded_state_dict()
    # what megatron's save stores beside the tensors: the non-sharded rest of {"model": ...}
    _, common = extract_sharded_base({"model": sharded})
    chunks, objects = [], [ShardedObject("common_state", common, (1,), (0,))]
    for name, entry in sharded.items():
        if isinstance(entry, ShardedObject):
            objects.append(entry)
            continue
        tensors = pieces_of(name, entry)
        param = params[name]
        if param.storage_offset() or not param.is_contiguous():
            raise ValueError(f"{name}: a parameter that is not a whole contiguous tensor cannot be streamed")
        for st in tensors:
            assert st.prepend_axis_num == 0, name
            stacked = ".experts." in name and param.dim() == 3 and st.data.shape[0] > expert_group
            spans = [(lo, min(lo + expert_group, st.data.shape[0])) for lo in range(0, st.data.shape[0], expert_group)] \
                if stacked else [None]
            for span in spans:
                data = st.data if span is None else st.data[span[0]:span[1]]
                offset = tuple(st.global_offset) if span is None else (st.global_offset[0] + span[0], *st.global_offset[1:])
                chunks.append(Chunk(st.key, offset, tuple(data.shape), tuple(st.global_shape), name,
                                    (tuple(data.shape), tuple(data.stride()), data.storage_offset()),
                                    span if span is None else (offset[0], offset[0] + data.shape[0])))
    return chunks, objects


def _view(tensor: torch.Tensor, chunk: Chunk, rows_from: int = 0, param_stride0: int = 0) -> torch.Tensor:
    size, stride, storage_offset = chunk.view
    return tensor.as_strided(size, stride, storage_offset - rows_from * param_stride0)


def _width(param: torch.Tensor) -> int:
    """The columns our tensor is read in: its last dim (a row of a weight, one expert's row)."""
    return param.shape[-1] if param.dim() else 1


def _rows_touched(size, stride, offset: int, width: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """The rows and columns of a [N, width] matrix that the strided view (size, stride, offset) of
    its storage reads: (row runs [(first, count)], sorted and disjoint; (first col, end col)). Each
    axis of the views we get steps whole rows (a stride of whole rows) or within a row (a stride below
    one row); an axis that does neither, or columns that wrap into the next row, take the whole rows
    from the view's first element to its last (never met with megatron's slices, kept for safety)."""
    if any(n == 0 for n in size):
        return [], (0, 0)
    axes = [(n, s) for n, s in zip(size, stride) if n > 1]
    within = [(n, s) for n, s in axes if s < width]
    across = sorted(((n, s // width) for n, s in axes if s >= width and s % width == 0), key=lambda a: a[1])
    c0 = offset % width
    c1 = c0 + 1 + sum((n - 1) * s for n, s in within)
    starts_count = 1
    for n, _ in across[1:] if across and across[0][1] == 1 else across:
        starts_count *= n
    if len(within) + len(across) != len(axes) or c1 > width or starts_count > 1 << 20:
        last = offset + sum((n - 1) * s for n, s in axes)
        return [(offset // width, last // width - offset // width + 1)], (0, width)
    run = across.pop(0)[0] if across and across[0][1] == 1 else 1
    starts = [offset // width]
    for n, s in across:
        starts = [x + k * s for x in starts for k in range(n)]
    runs: list[tuple[int, int]] = []
    for x in sorted(starts):
        if runs and x <= runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], x + run - runs[-1][0]))
        else:
            runs.append((x, run))
    return runs, (c0, c1)


def _read_region(c: Chunk, lo: list[int], hi: list[int], src, folder: SafetensorsFolder, m, adapter,
                 width: int) -> torch.Tensor:
    """Elements ``lo:hi`` (in the global coordinates of ``c``'s key) of chunk ``c``, read from the HF
    files alone: the rows and columns of our TP=1 tensor (a matrix of ``width`` columns) that they
    touch, each taken from the HF rows it is made of (``adapter.hf_rows``). A TP rank reads its rows
    (column-parallel) or its columns (row-parallel), an EP rank its experts, and a fused HF tensor
    (GDN's in_proj parts, gate/up, transformers' stacked experts) only the part the chunk is of."""
    size, stride, offset = c.view
    offset += sum((a - o) * st for a, o, st in zip(lo, c.offset, stride))
    size = [h - a for a, h in zip(lo, hi)]
    runs, (c0, c1) = _rows_touched(size, stride, offset, width)
    dtype = folder.dtype(src.hf[0])
    if not runs:
        return torch.empty(size, dtype=dtype)
    # a buffer from the first row read to the last; the rows between runs are never looked at
    first, cols = runs[0][0], c1 - c0
    buf = torch.empty((runs[-1][0] + runs[-1][1] - first, cols), dtype=dtype)
    pieces = adapter.hf_rows(src, m, width, folder.shape)
    ends = [ours + n for ours, _, _, n in pieces]
    for a, n in runs:
        for ours, name, theirs, count in pieces[bisect.bisect_right(ends, a):]:
            if ours >= a + n:
                break
            r0, r1 = max(a, ours), min(a + n, ours + count)
            rows = (theirs + r0 - ours, theirs + r1 - ours)
            buf[r0 - first:r1 - first] = folder.read_rows(name, width, rows, (c0, c1))
    strides = stride if cols == width else [s // width * cols if s >= width else s for s in stride]
    return buf.as_strided(size, strides, (offset // width - first) * cols + offset % width - c0)


# ------------------------------------------------------------------------------------------ import


class _StreamingPlanner:
    """A torch DCP save planner whose items are made when the writer asks for them."""

    def __new__(cls, *args, **kwargs):
        from torch.distributed.checkpoint import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            def __init__(self, items, produce):
                super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
                self._items, self._produce = items, produce

            def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
                super().set_up_planner({}, storage_meta, is_coordinator)

            def create_local_plan(self):
                from torch.distributed.checkpoint.planner import SavePlan

                self.plan = SavePlan(self._items)
                return self.plan

            def resolve_data(self, write_item):
                return self._produce(write_item)

        return Planner(*args, **kwargs)


def _write_items(chunks: list[Chunk], objects: list, dtype_of: Callable[[Chunk], torch.dtype]):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = []
    for c in chunks:
        offset = torch.Size(c.offset)
        items.append(WriteItem(
            index=MetadataIndex(c.key, offset), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offset, sizes=torch.Size(c.shape)),
                                        properties=TensorProperties(dtype=dtype_of(c)), size=torch.Size(c.global_shape))))
    for obj in objects:
        items.append(WriteItem(index=MetadataIndex(obj.unique_key), type=WriteItemType.BYTE_IO))
    return items


class Progress:
    """Bytes done, drawn as a bar on a terminal; ``rate()`` in GB/s at the end."""

    def __init__(self, total: int, what: str):
        from tqdm import tqdm

        self.start, self.done, self._lock = time.perf_counter(), 0, threading.Lock()
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=not os.isatty(2), leave=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self.bar.update(nbytes)

    def close(self) -> tuple[float, float]:
        self.bar.close()
        seconds = time.perf_counter() - self.start
        return seconds, self.done / max(seconds, 1e-9) / 1e9


def unmapped(hf_names: list[str], sources: dict) -> list[str]:
    """The checkpoint's tensors no tensor of ours is made of."""
    return sorted(set(hf_names) - {n for src in sources.values() for n in src.hf})


def absent(hf_names: list[str], sources: dict) -> list[str]:
    """The HF tensors the model needs that the checkpoint does not hold."""
    return sorted({n for src in sources.values() for n in src.hf} - set(hf_names))


def import_hf(hf_dir: str | Path, out: str | Path, adapter, family, workers: int = 1) -> tuple[Path, dict]:
    """Write ``hf_dir``'s weights as our weights-only dist-checkpoint (iter_0000000 + latest)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    from multimodal import checkpoint_checks as checks
    from multimodal import checkpointing

    folder = SafetensorsFolder(hf_dir)
    m = adapter.model_config_from_hf(hf_dir)
    sources = adapter.hf_sources(m, folder.names)
    extra = unmapped(folder.names, sources)
    if extra:
        raise ValueError(f"{hf_dir}: {len(extra)} tensor(s) map to nothing in the model its config.json "
                         f"describes, e.g. {extra[0]}; check config.json against the weights (nothing is "
                         "dropped in silence)")
    missing = absent(folder.names, sources)
    if missing:
        raise ValueError(f"{hf_dir}: config.json needs {len(missing)} tensor(s) the checkpoint lacks, e.g. {missing[0]}")
    model = meta_model(m, family)
    chunks, objects = chunk_plan(model)
    by_index = {(c.key, c.offset): c for c in chunks}
    objects_by_key = {o.unique_key: o for o in objects}
    params = dict(model.named_parameters())

    def dtype_of(c: Chunk) -> torch.dtype:
        return folder.dtype(sources[c.param].hf[0])

    total = sum(torch.Size(c.shape).numel() * dtype_of(c).itemsize for c in chunks)
    progress = Progress(total, "import")

    def produce(item):
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([objects_by_key[item.index.fqn].data], buf)  # megatron stores a list per key
            buf.seek(0)
            return buf
        c = by_index[(item.index.fqn, tuple(item.index.offset))]
        data = _read_region(c, list(c.offset), [o + n for o, n in zip(c.offset, c.shape)], sources[c.param], folder,
                            m, adapter, _width(params[c.param]))
        progress.add(data.numel() * data.element_size())
        return data.clone()  # the chunk alone: the writer keeps nothing that pins the rows read around it

    root = Path(out)
    final, tmp = root / "iter_0000000", root / "iter_0000000.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # a file per chunk: torch's writer keeps every tensor of a file until the file is closed
    writer = FileSystemWriter(str(tmp), single_file_per_rank=False, thread_count=max(1, workers), sync_files=False)
    try:
        dcp_save({}, storage_writer=writer, planner=_StreamingPlanner(_write_items(chunks, objects, dtype_of), produce),
                 no_dist=True)
        save_config(CheckpointingConfig("torch_dist"), str(tmp))
    except BaseException as e:  # a full disk: one line, the partial files removed (as a training save)
        error = checkpointing.disk_full_or(e, root, tmp, total)
        if error is e:
            raise
        raise error from e
    seconds, rate = progress.close()
    dtypes = sorted({str(dtype_of(c)).replace("torch.", "") for c in chunks})
    meta = {MODEL_CONFIG_FILE: json.dumps(dataclasses.asdict(m), indent=1),
            HF_CONFIG_FILE: (Path(hf_dir) / "config.json").read_text()}
    trainer = {"iteration": 0, "weights_only": True, "source": str(hf_dir), "hf_dtype": dtypes[0]}
    # the manifest's crc32s, read by the import's own workers: left to _commit, eight threads with a
    # 16 MiB buffer each would be the import's peak memory
    checks.write_rank_checksums(tmp, 0, threads=max(1, workers))
    # the training checkpoints' protocol: metadata, manifest, trainer_state.json last, rename, latest
    checkpointing._commit(root, tmp, final, trainer, meta, keep_last=0, need=total)
    for f in final.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o644)
    return final, {"bytes": progress.done, "seconds": seconds, "gb_per_s": rate, "tensors": len(folder.names)}


# ------------------------------------------------------------------------------------------ export


class _CheckpointReader:
    """Regions of a dist-checkpoint's tensors, whatever layout wrote them: only the stored chunks a
    region overlaps are read (torch's resharding reads, planned for the region alone)."""

    def __init__(self, ckpt: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.ckpt = ckpt
        self.metadata = FileSystemReader(str(ckpt)).read_metadata()
        self.stored = self.metadata.state_dict_metadata

    def read(self, regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """key -> (offset, shape) of the region wanted -> key -> that region."""
        from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        missing = sorted(set(regions) - set(self.stored))
        if missing:
            raise KeyError(f"{self.ckpt} holds no tensor {missing[0]} ({len(missing)} missing); was it saved "
                           "from this model?")
        state = {k: torch.empty(shape, dtype=self.stored[k].properties.dtype) for k, (_, shape) in regions.items()}
        items = [item for k, (offset, shape) in regions.items() for item in create_read_items_for_chunk_list(
            k, self.stored[k], [ChunkStorageMetadata(torch.Size(offset), torch.Size(shape))])]
        class RegionPlanner(DefaultLoadPlanner):
            def lookup_tensor(self, index):  # each key's region is the whole destination tensor
                return self.state_dict[index.fqn]

        reader = FileSystemReader(str(self.ckpt))
        reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        planner = RegionPlanner()
        planner.set_up_planner(state, self.metadata, True)
        plan = reader.prepare_global_plan([reader.prepare_local_plan(LoadPlan(items))])[0]
        reader.read_data(plan, planner).wait()
        return state


def _load_part(reader: _CheckpointReader, part: list[tuple[str, tuple[int, int] | None]],
               chunks_of: dict[str, list[Chunk]], params: dict) -> dict[str, tuple[torch.Tensor, int]]:
    """Our (TP=1) tensors of one export unit: (param, None) whole, (param, (lo, hi)) those experts of
    a stacked expert weight. Returns param -> (tensor, first expert)."""
    regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, experts in part:
        for c in chunks_of[name]:
            shape = reader.stored[c.key].size
            if experts is None:
                regions[c.key] = ((0,) * len(shape), tuple(shape))
            else:  # the expert axis is the key's first
                regions[c.key] = ((experts[0], *(0,) * (len(shape) - 1)), (experts[1] - experts[0], *shape[1:]))
    loaded = reader.read(regions)
    out = {}
    for name, experts in part:
        lo = experts[0] if experts else 0
        shape = params[name].shape if experts is None else (experts[1] - experts[0], *params[name].shape[1:])
        target = None
        for c in chunks_of[name]:
            region = loaded[c.key]
            if target is None:
                target = torch.empty(shape, dtype=region.dtype)
            if experts is None:
                _view(target, c).copy_(region[tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape))])
            else:
                sub = Chunk(c.key, (lo, *c.offset[1:]), (experts[1] - lo, *c.shape[1:]), c.global_shape, name,
                            _sub_view(c, experts), experts)
                dst = _view(target, sub, lo, params[name].stride(0))
                dst.copy_(region[(slice(None), *(slice(o, o + s) for o, s in zip(c.offset[1:], c.shape[1:])))])
        out[name] = (target, lo)
    return out


def export_hf(ckpt: Path, out: str | Path, m, adapter, family, dtype: torch.dtype | None, hf_config: dict,
              max_shard_bytes: int, workers: int = 1, carry: SafetensorsFolder | None = None,
              carry_prefix: str = "mtp.", rank: int = 0, world: int = 1,
              expert_group: int = EXPERT_GROUP) -> dict:
    """Write our checkpoint at ``ckpt`` as HF safetensors shards + index + config.json in ``out``.
    A unit is what one worker holds at a time: a layer's other tensors, or ``expert_group`` of its
    experts. ``carry``: an HF folder whose ``carry_prefix`` tensors this model does not hold (an MTP
    head that was not trained) are copied over unchanged. ``rank``/``world``: every rank of a run
    writes every world-th shard, and rank 0 the index and config.json."""
    model = meta_model(m, family)
    params = dict(model.named_parameters())
    sources = adapter.hf_sources(m)
    chunks_of: dict[str, list[Chunk]] = {}
    for c in chunk_plan(model, expert_group=1 << 30)[0]:
        chunks_of.setdefault(c.param, []).append(c)
    reader = _CheckpointReader(ckpt)
    drop = {"lm_head.weight"} if m.tie_word_embeddings else set()

    # the units, in model order, and every HF tensor each writes (dtype, shape) from the meta model
    parts: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    entries_of_unit: dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]] = {}
    for name, src in sources.items():
        stacked = src.kind in ("experts_fc1", "experts_fc2")
        spans = [(lo, min(lo + expert_group, m.num_experts)) for lo in range(0, m.num_experts, expert_group)] \
            if stacked else [None]
        out_dtype = dtype or reader.stored[chunks_of[name][0].key].properties.dtype
        for span in spans:
            unit = src.unit if span is None else f"{src.unit}.experts.{span[0]}"
            parts.setdefault(unit, []).append((name, span))
            meta = params[name] if span is None else params[name][span[0]:span[1]]
            for hf_name, t in adapter.split_to_hf(src, meta, m, span[0] if span else 0).items():
                if hf_name not in drop:
                    entries_of_unit.setdefault(unit, []).append((hf_name, out_dtype, tuple(t.shape)))
    produced = {e[0] for v in entries_of_unit.values() for e in v}
    carried = [n for n in carry.names if n.startswith(carry_prefix) and n not in produced] if carry else []
    if carried:
        entries_of_unit["carried"] = [(n, carry.dtype(n), carry.shape(n)) for n in carried]
    units = [(u, sum(torch.Size(s).numel() * d.itemsize for _, d, s in entries)) for u, entries in entries_of_unit.items()]
    shards = plan_shards(units, max_shard_bytes)
    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)
    progress = Progress(sum(s for _, s in units), "export")
    weight_map: dict[str, str] = {}

    def write(k: int):
        """Shard k, one unit at a time: what is held is the unit being written."""
        file = shard_name(k, len(shards))
        shard = ShardFile(outd / file, [e for u in shards[k] for e in entries_of_unit[u]])
        for unit in shards[k]:
            if unit == "carried":
                tensors = {n: carry.get(n) for n in carried}
            else:
                tensors = {}
                for name, (t, first) in _load_part(reader, parts[unit], chunks_of, params).items():
                    for hf_name, piece in adapter.split_to_hf(sources[name], t, m, first).items():
                        if hf_name not in drop:
                            tensors[hf_name] = piece if dtype is None else piece.to(dtype)
            for hf_name, t in tensors.items():
                shard.write(hf_name, t)
                progress.add(t.numel() * t.element_size())
            del tensors
        return dict.fromkeys((e[0] for u in shards[k] for e in entries_of_unit[u]), file), shard.close()

    total = 0
    mine = [k for k in range(len(shards)) if k % world == rank]  # under torchrun: each rank its shards
    for names, nbytes in run_parallel([lambda k=k: write(k) for k in mine], workers):
        weight_map.update(names)
        total += nbytes
    seconds, rate = progress.close()
    if world > 1:
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, (weight_map, total, rate))
        weight_map = {k: v for part in gathered for k, v in part[0].items()}
        total, rate = sum(p[1] for p in gathered), sum(p[2] for p in gathered)
    if rank == 0:
        write_index(outd, weight_map, total)
        (outd / "config.json").write_text(json.dumps(hf_config, indent=2))
        os.chmod(outd / "config.json", 0o644)
    return {"tensors": len(weight_map), "shards": len(shards), "bytes": total, "seconds": seconds,
            "gb_per_s": rate, "carried": len(carried)}


def copy_processor_files(src: Path, out: Path) -> list[str]:
    """The tokenizer, chat template and processor files of an HF folder, copied beside an export."""
    copied = []
    for f in sorted(src.iterdir()) if src.is_dir() else []:
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json") and (f.suffix in (".json", ".jinja", ".txt", ".model")
                                                                    or f.name.startswith(("tokenizer", "vocab", "merges"))):
            shutil.copyfile(f, out / f.name)
            os.chmod(out / f.name, 0o644)
            copied.append(f.name)
    return copied


def write_random_hf(m, adapter, family, out: str | Path, dtype: torch.dtype = torch.bfloat16,
                    max_shard_bytes: int = 5 * 10**9, seed: int = 0) -> dict:
    """A synthetic HF checkpoint of model section ``m`` (random weights, the released layout:
    config.json, shards, index), written shard by shard: for conversion benchmarks and memory
    tests at depths no fixture reaches."""
    model = meta_model(m, family)
    params = dict(model.named_parameters())
    units: dict[str, dict[str, tuple]] = {}
    for name, src in adapter.hf_sources(m).items():
        for hf_name, t in adapter.split_to_hf(src, params[name], m).items():
            if not (m.tie_word_embeddings and hf_name == "lm_head.weight"):
                units.setdefault(src.unit, {})[hf_name] = tuple(t.shape)
    sized = [(u, sum(torch.Size(s).numel() * dtype.itemsize for s in names.values())) for u, names in units.items()]
    shards = plan_shards(sized, max_shard_bytes)
    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        g = torch.Generator().manual_seed(seed + k)
        tensors = {n: (torch.randn(s, generator=g) * 0.02).to(dtype) for u in shard for n, s in units[u].items()}
        file = shard_name(k, len(shards))
        total += write_shard(outd / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    write_index(outd, weight_map, total)
    (outd / "config.json").write_text(json.dumps(adapter.hf_config_from_ours(m), indent=2))
    return {"tensors": len(weight_map), "shards": len(shards), "bytes": total}


# ------------------------------------------------------------------------------ direct loading


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face checkpoint folder (config.json + safetensors), as ``checkpoint.load`` takes it."""
    from core.safetensors_io import is_safetensors_folder

    return (Path(path) / "config.json").is_file() and is_safetensors_folder(path)


@dataclass
class ReferencePlan:
    """Where every stored tensor of the TP=1 model lives in our TP=1 parameters."""

    chunks: dict[str, list[Chunk]]
    width: dict[str, int]  # the columns each parameter is read in (_width)


def reference_plan(m, family) -> ReferencePlan:
    """The TP=1 chunk plan of model section ``m``. Megatron's layers read the global parallel
    state, so this runs while that state is every size 1: call it before the run's layout is set
    up (it sets up and tears down a trivial one itself when none is)."""
    from megatron.core import parallel_state as ps

    from core.seeding import seed_everything

    own = not ps.model_parallel_is_initialized()
    if own:
        ps.initialize_model_parallel(1, 1)
    elif ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() \
            * ps.get_expert_model_parallel_world_size() * ps.get_context_parallel_world_size() > 1:
        raise RuntimeError("reference_plan needs the TP=PP=EP=CP=1 parallel state; call it before the layout's")
    try:
        seed_everything(0)
        reference = meta_model(m, family)
        plan: dict[str, list[Chunk]] = {}
        for c in chunk_plan(reference)[0]:
            plan.setdefault(c.key, []).append(c)
        widths = {n: _width(p) for n, p in reference.named_parameters()}
    finally:
        if own:
            ps.destroy_model_parallel()
    return ReferencePlan(plan, widths)


def load_hf_weights(model, hf_dir: str | Path, m, adapter, plan: ReferencePlan) -> dict:
    """Fill this rank's ``model`` (any TP/PP/EP/CP layout) from an HF folder, with no conversion
    step: every piece the rank holds is cut out of the TP=1 tensor it belongs to (``plan``, from
    ``reference_plan``) and read from the files alone (``_read_region``): a rank reads the tensors
    of its own pipeline stage, of those its TP rows or columns, and of a stacked expert weight its
    own experts. LoRA adapters, which HF weights do not have, keep their initial values. Returns
    counts for the log (``read``: the bytes read from the files)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from models.common.layout_init import pieces_of
    from models.common.lora import is_adapter_param

    folder = SafetensorsFolder(hf_dir)
    sources = adapter.hf_sources(m, folder.names)
    missing = absent(folder.names, sources)
    if missing:
        hint = ("; set model.mtp_num_layers=0 to train without an MTP head" if missing[0].startswith("mtp.")
                else "; does config.json describe these weights?")
        raise ValueError(f"checkpoint.load={hf_dir}: {len(missing)} tensor(s) the model needs are not in the "
                         f"folder, e.g. {missing[0]}{hint}")
    done = {"tensors": 0, "bytes": 0, "fresh": 0}
    with torch.no_grad():
        for name, entry in model.sharded_state_dict().items():
            if isinstance(entry, ShardedObject):
                continue
            for st in pieces_of(name, entry):
                if st.key not in plan.chunks:
                    if is_adapter_param(name):
                        done["fresh"] += 1
                        continue
                    raise KeyError(f"checkpoint.load={hf_dir}: no Hugging Face tensor maps to {st.key}")
                _fill(st, plan.chunks[st.key], sources, folder, m, plan.width, adapter)
                done["tensors"] += 1
                done["bytes"] += st.data.numel() * st.data.element_size()
    folder.close()
    done["read"] = sum(folder.bytes_read.values())
    done["read_by_tensor"] = dict(folder.bytes_read)
    return done


def _fill(st, chunks: list[Chunk], sources: dict, folder: SafetensorsFolder, m, widths: dict, adapter) -> None:
    """Copy into ``st.data`` (this rank's piece of a global tensor, at ``st.global_offset``) the
    overlapping parts of the TP=1 chunks that store that tensor."""
    if st.prepend_axis_num:  # (pieces_of already refused flattened ones)
        raise ValueError(f"{st.key}: a shard with prepended axes cannot be loaded from Hugging Face directly")
    offset, shape = list(st.global_offset), list(st.local_shape)
    for c in chunks:
        lo = [max(a, b) for a, b in zip(offset, c.offset)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(offset, shape, c.offset, c.shape)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        region = _read_region(c, lo, hi, sources[c.param], folder, m, adapter, widths[c.param])
        st.data[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset))].copy_(region)


def _sub_view(c: Chunk, experts: tuple[int, int]) -> tuple:
    """The view geometry of rows ``experts`` of an expert chunk."""
    size, stride, storage_offset = c.view
    first = experts[0] - c.offset[0]
    return ((experts[1] - experts[0], *size[1:]), stride, storage_offset + first * stride[0])



def save_hf_from_run(ckpt: Path, out: str | Path, m, family, rank: int, world: int) -> dict:
    """``checkpoint.save_hf``: the run's final checkpoint as a Hugging Face folder, every rank writing
    its share of the shards. The config is the source folder's (``model.hf_config``) when there is
    one, with its tokenizer and processor files and, when this run trained no MTP head, that head
    copied over unchanged."""
    adapter = family.hf_adapter()
    source = None
    if m.hf_config and is_hf_folder(m.hf_config):
        source = SafetensorsFolder(m.hf_config)
    config_path = Path(m.hf_config) if m.hf_config else None
    if config_path is not None and config_path.is_dir():
        config_path = config_path / "config.json"
    hf_config = json.loads(config_path.read_text()) if config_path and config_path.is_file() \
        else adapter.hf_config_from_ours(m)
    text = hf_config.get("text_config", hf_config)
    carry = None
    if int(text.get("mtp_num_hidden_layers", 0) or 0) and not int(getattr(m, "mtp_num_layers", 0) or 0):
        if source is not None and any(n.startswith("mtp.") for n in source.names):
            carry = source
        else:
            text["mtp_num_hidden_layers"] = 0
    stats = export_hf(ckpt, out, m, adapter, family, None, hf_config, 5 * 10**9, workers=4, carry=carry,
                      rank=rank, world=world)
    if rank == 0 and source is not None:
        copy_processor_files(source.path, Path(out))
    return stats
