"""Megatron-Energon datasets (``data.name=energon``): a folder that ``energon prepare`` prepared
(WebDataset tar shards + ``.nv-meta/``), read as conversations.

What comes from the ``megatron-energon`` package: the folder's own description of itself
(``.nv-meta/dataset.yaml``: the sample type and its ``field_map`` or ``sample_loader``, the
``split.yaml`` parts and excluded samples), its sample types, and its indexed tar reader, which
reads sample ``i`` of a split from the ``.tar.idx`` byte offsets ``energon prepare`` wrote.

What does not: energon's loader, its worker sharding and its savable state. Our loader
(``data/loader.py``) reads any data set by global index: data-parallel rank r reads samples
r, r+DP, ..., decode workers change nothing of the batches, and the resumable state is the next
index plus the packer's read-ahead, so a resume is bit-exact whatever the worker count.
Energon's savable loader keeps a state per rank and worker (shard-slice positions, shuffle
buffers, RNG), tied to its worker count, and yields samples in its own order, which would
replace that contract for this one data set; random access by index keeps it for all of them.

Each energon sample becomes a conversation record and goes through ``ConversationsDataset``: the
same chat template, image and video preprocessing and skip counts, so token ids, loss masks,
pixel values and grids equal those of ``data.name=conversations`` for the same content
(``tests/test_energon.py``). Sample types:

- ``CrudeSample`` (``dataset.yaml``: ``__class__: CrudeWebdataset``): the ``record_part`` part
  (default ``json``) holds a conversations record in either form (``docs/data.md``); an image or
  video that names another part of the sample (``"image": "img0.jpg"`` for the tar member
  ``KEY.img0.jpg``) reads that part's bytes. ``python -m data.energon_write`` writes such a set
  from a conversations file.
- ``VQASample``: user = image + ``context``; assistant = the answer of highest ``answer_weights``
  (the first when there are none).
- ``CaptioningSample``: user = image (+ ``data.energon.caption_prompt``); assistant = ``caption``.

Images and videos reach our preprocessing as the bytes stored in the shard (the energon decoder
used here leaves media undecoded; JSON and text parts are decoded as energon decodes them).
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

from core.errors import DataError
from data.conversations import ConversationsDataset
from data.cord_v2 import SkipSample
from data.energon_config import EnergonConfig
from data.record_sources import RecordSourceError  # a DataError: one line, exit code 2

INSTALL = 'pip install -e ".[energon]"'
META = ".nv-meta"


def check_prepared(path: str | None) -> Path:
    """``path`` as a prepared energon folder, or a one-line error naming the fix."""
    if not path:
        raise RecordSourceError("data.name=energon needs data.path: a folder prepared with `energon prepare DIR`")
    folder = Path(path)
    if folder.is_file() and folder.suffix in (".yaml", ".yml"):
        raise RecordSourceError(f"data.path={path!r} is an energon metadataset; data.name=energon reads one "
                                "prepared dataset folder: point data.path at it")
    if folder.is_file():
        raise RecordSourceError(f"data.path={path!r} is a file; data.name=energon reads a folder prepared with "
                                "`energon prepare DIR` (a conversations file: data.name=conversations)")
    if not folder.is_dir():
        raise RecordSourceError(f"data.path={path!r} does not exist; point it at a folder of WebDataset shards "
                                "prepared with `energon prepare DIR`")
    if not any((folder / META / name).is_file() for name in (".info.json", ".info.yaml")):
        raise RecordSourceError(f"data.path={path!r} is not a prepared energon dataset (no {META}/.info.json); "
                                f"run `energon prepare {path}`")
    if not (folder / META / "dataset.yaml").is_file():
        raise RecordSourceError(f"data.path={path!r} has no {META}/dataset.yaml (its sample type); run "
                                f"`energon prepare {path}` and choose the sample type")
    return folder


def energon_modules():
    """The megatron-energon modules this file uses, imported on first use (an optional extra)."""
    try:
        from megatron import energon
        from megatron.energon.dataset_config import get_dataset_from_config
        from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
        from megatron.energon.flavors.webdataset.sample_decoder import SampleDecoder
    except ImportError as e:
        raise DataError(f"data.name=energon needs the megatron-energon package ({e}); {INSTALL}") from None
    return energon, get_dataset_from_config, ShardInfosITarReader, SampleDecoder


def _media_as_bytes_decoder():
    """An energon decoder that decodes JSON, text and numbers as energon does but leaves images
    and videos as their stored bytes, so that they are opened, made upright and resized exactly
    as conversation files are (``data/image.py``), not by webdataset's image handler."""
    import webdataset

    _, _, _, SampleDecoder = energon_modules()

    class MediaAsBytes(SampleDecoder):
        def __init__(self):
            super().__init__()
            self._decoder = webdataset.autodecode.Decoder([])  # its basic handlers only: json, txt, cls, ...

        def config(self) -> dict:
            return {"media": "bytes"}

    return MediaAsBytes()


def map_media(record: dict, fn) -> dict:
    """A copy of a conversations record (either form) with each image and video reference ``v``
    replaced by ``fn(v, kind)``, kind ``"image"`` or ``"video"`` (a video given as frames is one
    reference: its list)."""
    record = dict(record)
    for key, kind in (("image", "image"), ("images", "image"), ("video", "video"), ("videos", "video")):
        if record.get(key) is not None:  # the LLaVA/ShareGPT form: "image" may be one or a list
            value = record[key]
            many = key.endswith("s") or (key == "image" and isinstance(value, list))
            record[key] = [fn(v, kind) for v in value] if many else fn(value, kind)
    if isinstance(record.get("messages"), list):
        messages = []
        for msg in record["messages"]:
            if isinstance(msg, dict) and isinstance(msg.get("content"), list):
                content = []
                for part in msg["content"]:
                    if isinstance(part, dict):
                        part = {k: fn(v, "video" if k == "video" else "image")
                                if k in ("image", "image_url", "video") and v is not None else v
                                for k, v in part.items()}
                    content.append(part)
                msg = {**msg, "content": content}
            messages.append(msg)
        record["messages"] = messages
    return record


def _part_bytes(value, parts: dict):
    """A media reference with part names replaced by those parts' bytes (a frame list too)."""
    if isinstance(value, list):
        return [_part_bytes(v, parts) for v in value]
    return parts[value] if isinstance(value, str) and isinstance(parts.get(value), bytes) else value


def attach_parts(record: dict, parts: dict) -> dict:
    """A conversations record whose images and videos name parts of the same energon sample, with
    those references replaced by the parts' bytes (others are left for the conversations reader)."""
    return map_media(record, lambda value, kind: _part_bytes(value, parts))


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _best_answer(sample) -> str:
    answers = list(sample.answers or [])
    if not answers:
        raise SkipSample("empty_answer", "the VQA sample has no answers")
    weights = sample.answer_weights
    if weights is not None and len(weights) == len(answers):
        return _text(answers[int(max(range(len(answers)), key=lambda i: float(weights[i])))])
    return _text(answers[0])


class EnergonRecords:
    """The samples of one split of a prepared energon folder, by index, as conversation records."""

    def __init__(self, folder: Path, cfg: EnergonConfig):
        energon, get_dataset_from_config, _, _ = energon_modules()
        try:
            self.factory = get_dataset_from_config(
                folder, split_part=cfg.split_part, training=False, decoder=_media_as_bytes_decoder(),
                worker_config=energon.WorkerConfig(rank=0, world_size=1, num_workers=0))
        except AssertionError as e:  # energon states a bad split part or field map as an assertion
            raise RecordSourceError(f"data.path={str(folder)!r}: {e} "
                                    f"(data.energon.split_part={cfg.split_part!r})") from None
        kind = self.factory.__sample_type__
        convert = next((fn for t, fn in self._converters(energon).items() if issubclass(kind, t)), None)
        if convert is None:
            raise RecordSourceError(f"data.path={str(folder)!r} holds energon {kind.__name__} samples; "
                                    "data.name=energon reads CrudeSample (conversation records), VQASample and "
                                    "CaptioningSample")
        self.folder, self.cfg, self.convert, self.sample_type = folder, cfg, convert, kind.__name__
        self.length = len(self.factory)
        self._reader, self._pid = None, None

    def _converters(self, energon) -> dict:
        return {energon.CrudeSample: self._crude, energon.VQASample: self._vqa,
                energon.CaptioningSample: self._captioning}

    def __len__(self) -> int:
        return self.length

    def reader(self):
        """This process's tar reader: a decode worker forked from the trainer opens its own
        files, since a shared file offset would mix two processes' reads."""
        if self._pid != os.getpid():
            _, _, ShardInfosITarReader, _ = energon_modules()
            f = self.factory
            self._reader = ShardInfosITarReader(f.path, f.shards, part_filter=f.part_filter,
                                                sample_filter=f.sample_filter)
            self._pid = os.getpid()
            # closed before the interpreter tears down the storage client its files report to
            atexit.register(self._reader.close)
        return self._reader

    def __getitem__(self, index: int) -> dict:
        raw = self.reader()[int(index)]
        if raw is None:
            raise SkipSample("excluded", f"sample {index} is excluded by {META}/split.yaml")
        try:
            sample = self.factory.load_sample(raw)
        except Exception as e:  # a field_map or sample_loader that does not fit this sample
            raise SkipSample("bad_record", f"energon sample {raw['__key__']} of {raw['__shard__']} does not load "
                             f"as {self.sample_type} ({type(e).__name__}: {e})") from None
        return self.convert(sample)

    def _crude(self, sample) -> dict:
        record = sample.get(self.cfg.record_part)
        if isinstance(record, (bytes, str)):
            try:
                record = json.loads(record)
            except ValueError as e:
                raise SkipSample("bad_json", f"part {self.cfg.record_part!r} is not JSON ({e})") from None
        if not isinstance(record, dict):
            raise SkipSample("bad_record", f"sample {sample.get('__key__')} has no {self.cfg.record_part!r} part "
                             "holding a conversation record (data.energon.record_part)")
        return attach_parts(record, sample)

    def _vqa(self, sample) -> dict:
        user = [{"type": "image", "image": sample.image}, {"type": "text", "text": _text(sample.context)}]
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": _best_answer(sample)}]}

    def _captioning(self, sample) -> dict:
        user = [{"type": "image", "image": sample.image}]
        if self.cfg.caption_prompt:
            user.append({"type": "text", "text": self.cfg.caption_prompt})
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": _text(sample.caption)}]}


class EnergonDataset(ConversationsDataset):
    """A prepared energon folder -> ``ConversationsDataset`` samples (``None`` for a skipped one)."""

    def __init__(self, model_cfg, data_cfg, seq_length: int, tokenizer):
        folder = check_prepared(data_cfg.path)
        cfg = getattr(data_cfg, "energon", None) or EnergonConfig()
        super().__init__(model_cfg, data_cfg, seq_length, tokenizer, records=EnergonRecords(folder, cfg))
