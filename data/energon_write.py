"""Write a conversations file as a prepared Megatron-Energon dataset (``data.name=energon``).

    python -m data.energon_write RECORDS OUT [--samples-per-shard N] [--image-root DIR] [--split train:1]

RECORDS is anything ``data.name=conversations`` reads (``.jsonl``, ``.json``, a ``datasets``
folder). Each record becomes one sample of CrudeSample type: its ``json`` part is the record,
with every image and video it references (a path, ``data:`` URL or bytes) stored beside it as a
part (``img0.png``, ``vid0.mp4``, ...) that the record names instead. ``energon prepare``'s own
API then writes ``.nv-meta/`` (shard counts, ``.tar.idx`` offsets, the index, ``split.yaml``),
and ``dataset.yaml`` declares the crude sample type. Reading the result with ``data.name=energon``
gives the samples ``data.name=conversations`` gives for RECORDS (``tests/test_energon.py``).
A reference that cannot be read is left as it is, so the reader counts it as the conversations
reader would (``missing_image``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import tarfile
from pathlib import Path

from data.energon import energon_modules, map_media
from data.record_sources import open_records

CRUDE_DATASET_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"


def _media_bytes(src, root: Path) -> tuple[bytes, str] | None:
    """(bytes, file extension) of an image or video reference, or None when it does not resolve."""
    if isinstance(src, dict):  # a datasets Image value, or OpenAI's {"url": ...}
        src = src.get("bytes") or src.get("path") or src.get("url")
    if isinstance(src, (bytes, bytearray)):
        return bytes(src), _extension(bytes(src), "")
    if not isinstance(src, str) or not src:
        return None
    if src.startswith("data:"):
        try:
            data = base64.b64decode(src.split(",", 1)[1], validate=True)
        except (IndexError, ValueError):
            return None
        return data, _extension(data, "")
    path = Path(src.removeprefix("file://"))
    path = path if path.is_absolute() else root / path
    return (path.read_bytes(), path.suffix.lstrip(".").lower() or "bin") if path.is_file() else None


def _extension(data: bytes, default: str) -> str:
    try:
        from PIL import Image

        return (Image.open(io.BytesIO(data)).format or default or "bin").lower()
    except Exception:  # not an image PIL knows (a video): the name only tells decoders what it is
        return default or "bin"


class _Parts:
    """The media parts of one sample: each reference stored once, named ``img0.png``, ``vid0.mp4``..."""

    def __init__(self, root: Path):
        self.root, self.files = root, {}

    def ref(self, src, kind: str):
        if isinstance(src, list):  # a video given as frames
            return [self.ref(f, kind) for f in src]
        got = _media_bytes(src, self.root)
        if got is None:
            return src
        data, ext = got
        prefix = "img" if kind == "image" else "vid"
        name = f"{prefix}{sum(n.startswith(prefix) for n in self.files)}.{ext}"
        self.files[name] = data
        return name


def to_sample(record: dict, root: Path) -> dict[str, bytes]:
    """One record -> the parts of its energon sample (``json`` + one part per image or video)."""
    parts = _Parts(root)
    record = map_media(record, parts.ref)
    return {"json": json.dumps(record).encode(), **parts.files}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644  # mtime 0: the same records give the same shards
    tar.addfile(info, io.BytesIO(data))


def write_energon_dataset(records_path: str | Path, out: str | Path, samples_per_shard: int = 1000,
                          image_root: str | Path | None = None,
                          split_parts: tuple[tuple[str, float], ...] = (("train", 1.0),)) -> Path:
    """Write the records of ``records_path`` as tar shards under ``out`` and prepare them with
    energon (``.nv-meta/``); returns ``out``. Shards are split into ``split_parts`` by ratio, in
    order (no shuffle), so the sample order is the records' order."""
    energon_modules()  # the one-line install hint, before anything is written
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    records_path, out = Path(records_path), Path(out)
    root = Path(image_root) if image_root else records_path if records_path.is_dir() else records_path.parent
    records = open_records(records_path)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in range(0, len(records), samples_per_shard):
        name = f"shard-{len(shards):06d}.tar"
        with tarfile.open(out / name, "w") as tar:
            for i in range(start, min(start + samples_per_shard, len(records))):
                for part, data in to_sample(records[i], root).items():
                    _add(tar, f"{i:09d}.{part}", data)
        shards.append(name)
    BaseWebdatasetFactory.prepare_dataset(out, shards, split_parts_ratio=list(split_parts), shuffle_seed=None,
                                          workers=1)
    (out / ".nv-meta" / "dataset.yaml").write_text(CRUDE_DATASET_YAML)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", help="a .jsonl / .json file or datasets folder of conversation records")
    p.add_argument("out", help="the folder to write (tar shards + .nv-meta)")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--image-root", default=None, help="image paths are relative to it (default: the records' folder)")
    p.add_argument("--split", default="train:1", help="split parts and ratios, e.g. train:0.95,val:0.05")
    a = p.parse_args(argv)
    parts = tuple((k, float(v)) for k, v in (s.split(":") for s in a.split.split(",")))
    out = write_energon_dataset(a.records, a.out, a.samples_per_shard, a.image_root, parts)
    print(f"wrote {out} ({len(list(out.glob('*.tar')))} shards); train with data.name=energon data.path={out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
