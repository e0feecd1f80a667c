"""CORD-v2 receipts (``naver-clova-ix/cord-v2`` layout) as image -> structured-text samples.

One sample is a two-turn conversation: the user shows the receipt image and asks for its
fields (``prompt``); the assistant answers with the ``gt_parse`` of the row's ``ground_truth``,
either as JSON (``json.dumps``, keys in the data set's order, so the target is a pure function
of the row) or as Donut's tag sequence (``<s_menu><s_nm>..</s_nm>..</s_menu>``, list items
joined by ``<sep/>``). The output dict is the one ``data.mock.MockDataset`` yields, so the
collators and the model need nothing CORD-specific.

Real data is messy, and one bad row must not stop a long run: a row whose image does not
decode, whose text is not UTF-8, whose cell has the wrong type, whose JSON does not parse, that
lacks a field, has an empty answer or fails in any other way is *skipped*:
``__getitem__`` returns ``None``, counts the reason in ``self.skipped`` and logs a warning
with the index. A sample longer than ``seq_length`` is cut at the end (``self.truncated``),
never inside the image; if even the image does not fit, or nothing of the answer is left,
the sample is skipped too.

Files: ``{path}/{split}-*.parquet`` or ``{path}/data/{split}-*.parquet`` (the hub repo's
layout), or a ``datasets.save_to_disk`` folder (``{path}/{split}/data-*.arrow``). The split's
table is read once and kept in (Arrow) memory: CORD is ~1k receipts.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import torch

from data.chat import encode_conversation, special_token_ids
from data.image import CHECKPOINT_MAX_PIXELS, CHECKPOINT_MIN_PIXELS, image_patches, open_image, smart_resize  # noqa: F401 (re-exported)
from core.errors import DataError, one_line  # (a leaf module: imports nothing of the project)
from models import get_model_family

log = logging.getLogger(__name__)

DEFAULT_PROMPT = "Extract the receipt fields as JSON."
DONUT_PROMPT = "Extract the receipt fields as Donut tags."


class SkipSample(Exception):
    """A row that cannot become a sample; ``reason`` is the key counted in ``skipped``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def donut_tokens(obj) -> str:
    """Donut's ``json2token`` with keys in the given order (Donut's CORD recipe: sort_json_key=False)."""
    if isinstance(obj, dict):
        return "".join(f"<s_{k}>{donut_tokens(v)}</s_{k}>" for k, v in obj.items())
    if isinstance(obj, list):
        return "<sep/>".join(donut_tokens(v) for v in obj)
    return str(obj)


COLUMNS = ("image", "ground_truth")


def _check_columns(f: Path, names: list[str]) -> None:
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise DataError(f"{f}: missing column(s) {', '.join(missing)} (found: {', '.join(names) or 'none'}); "
                        "a CORD-v2 file needs image (struct with bytes) and ground_truth (JSON text)")


def _read_parquet(f: Path):
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(f).names
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid / OSError for a damaged file
        raise DataError(f"{f}: not a readable parquet file ({one_line(e)})") from None
    _check_columns(f, names)
    try:
        return pq.read_table(f, columns=list(COLUMNS))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{f}: reading columns {', '.join(COLUMNS)} failed ({one_line(e)})") from None


def _read_split(path: Path, split: str):
    import pyarrow as pa

    files = sorted(path.glob(f"{split}-*.parquet")) or sorted(path.glob(f"data/{split}-*.parquet"))
    if files:
        tables = [_read_parquet(f) for f in files]
        try:
            return pa.concat_tables(tables), files
        except Exception as e:  # noqa: BLE001 - column types differ between files
            raise DataError(f"the {split} files under {path} do not share one schema ({one_line(e)})") from None
    files = sorted((path / split).glob("data-*.arrow"))  # datasets.save_to_disk
    if files:
        tables = []
        for f in files:
            with pa.memory_map(str(f)) as src:
                table = pa.ipc.open_stream(src).read_all()
            _check_columns(f, table.column_names)
            tables.append(table.select(list(COLUMNS)))
        return pa.concat_tables(tables), files
    raise FileNotFoundError(
        f"no CORD-v2 files for split {split!r} under {path}: expected {split}-*.parquet, "
        f"data/{split}-*.parquet or {split}/data-*.arrow (set data.path to the data set folder)")


class CordV2Dataset(torch.utils.data.Dataset):
    """CORD-v2 rows -> ``MockDataset``-format samples (or ``None`` for skipped rows)."""

    def __init__(self, model_cfg, data_cfg, seq_length: int, tokenizer, split: str = "train",
                 prompt: str | None = None, target_format: str = "json",
                 min_pixels: int = CHECKPOINT_MIN_PIXELS, max_pixels: int = CHECKPOINT_MAX_PIXELS):
        if target_format not in ("json", "donut"):
            raise ValueError(f"target_format must be 'json' or 'donut', got {target_format!r}")
        if not getattr(data_cfg, "path", None):
            raise ValueError("data.path must name the CORD-v2 folder (parquet shards per split)")
        v = model_cfg.vision
        self.patch, self.tp, self.merge = v.patch_size, v.temporal_patch_size, v.spatial_merge_size
        self.position_ids = get_model_family(model_cfg.name).position_ids  # e.g. MRoPE's 3-D ids
        self.factor = self.patch * self.merge
        if min_pixels > max_pixels or max_pixels < self.factor**2:
            raise ValueError(f"need {self.factor ** 2} <= max_pixels and min_pixels <= max_pixels, "
                             f"got min_pixels={min_pixels}, max_pixels={max_pixels}")
        self.seq_length, self.tokenizer, self.split = seq_length, tokenizer, split
        self.target_format = target_format
        self.prompt = prompt if prompt is not None else (DEFAULT_PROMPT if target_format == "json" else DONUT_PROMPT)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.image_mean, self.image_std = tuple(data_cfg.image_mean), tuple(data_cfg.image_std)
        self.ids = special_token_ids(tokenizer)
        self._check_model_ids(model_cfg)
        self.table, self.files = _read_split(Path(data_cfg.path), split)
        self.skipped: collections.Counter = collections.Counter()
        self.truncated = 0

    def _check_model_ids(self, m) -> None:
        """The model must agree with the tokenizer on the ids it reads, or training is silently wrong."""
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if getattr(m, key) != self.ids[key]:
                raise ValueError(f"model.{key}={getattr(m, key)} but the tokenizer's id is {self.ids[key]}; "
                                 f"set model.{key}={self.ids[key]}")
        top = max(len(self.tokenizer), max(self.ids.values()) + 1)
        if top > m.vocab_size:
            raise ValueError(f"the tokenizer has ids up to {top - 1} but model.vocab_size={m.vocab_size}")

    def __len__(self) -> int:
        return self.table.num_rows

    # ------------------------------------------------------------------ pieces

    def _cell(self, column: str, index: int):
        """One cell as Python; text that is not UTF-8 is a bad row, not a crash."""
        try:
            return self.table.column(column)[index].as_py()
        except UnicodeDecodeError as e:
            raise SkipSample("bad_text", f"{column} is not UTF-8 text ({e})") from None

    def _answer(self, raw) -> str:
        if raw is None:
            raise SkipSample("missing_field", "ground_truth is missing")
        if isinstance(raw, (bytes, bytearray)):  # a binary column holding the JSON text
            try:
                raw = bytes(raw).decode("utf-8")
            except UnicodeDecodeError as e:
                raise SkipSample("bad_text", f"ground_truth is not UTF-8 text ({e})") from None
        if not isinstance(raw, str):
            raise SkipSample("wrong_type", f"ground_truth is a {type(raw).__name__}, not JSON text")
        try:
            gt = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SkipSample("bad_json", f"ground_truth is not valid JSON ({e})") from None
        if not isinstance(gt, dict) or "gt_parse" not in gt:
            raise SkipSample("missing_field", "ground_truth has no gt_parse")
        parse = gt["gt_parse"]
        if not parse:
            raise SkipSample("empty_answer", "gt_parse is empty")
        text = json.dumps(parse, ensure_ascii=False) if self.target_format == "json" else donut_tokens(parse)
        if not text.strip():
            raise SkipSample("empty_answer", "the answer renders empty")
        return text

    def _image(self, cell) -> tuple[torch.Tensor, torch.Tensor]:
        if cell is not None and not isinstance(cell, dict):
            raise SkipSample("wrong_type", f"image is a {type(cell).__name__}, not a struct with bytes")
        data = cell.get("bytes") if isinstance(cell, dict) else None
        if not data:
            raise SkipSample("missing_field", "image bytes are missing")
        if not isinstance(data, (bytes, bytearray)):
            raise SkipSample("wrong_type", f"image bytes are a {type(data).__name__}")
        try:
            img = open_image(data)
            smart_resize(img.height, img.width, self.factor, self.min_pixels, self.max_pixels)  # aspect check
        except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
            raise SkipSample("bad_image", f"image does not decode ({type(e).__name__}: {e})") from None
        return image_patches(img, self.patch, self.tp, self.merge, self.min_pixels, self.max_pixels,
                             self.image_mean, self.image_std)

    # ------------------------------------------------------------------ sample

    def __getitem__(self, index: int) -> dict | None:
        index = int(index)
        try:
            return self._sample(index)
        except SkipSample as e:
            reason, detail = e.reason, str(e)
        except Exception as e:  # noqa: BLE001 - any other per-row failure: skipped and counted, never fatal
            reason, detail = f"error_{type(e).__name__}", one_line(e)
        self.skipped[reason] += 1
        log.warning("cord_v2 %s sample %d skipped (%s): %s", self.split, index, reason, detail)
        return None

    def _sample(self, index: int) -> dict:
        answer = self._answer(self._cell("ground_truth", index))
        pixel_values, grid = self._image(self._cell("image", index))
        n_image = int(grid.prod()) // self.merge**2
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.prompt}]},
            {"role": "assistant", "content": answer},
        ]
        ids, mask = encode_conversation(self.tokenizer, messages, [n_image], self.ids)
        if len(ids) > self.seq_length:
            image_end = ids.index(self.ids["vision_end_token_id"]) + 1
            if image_end > self.seq_length:
                raise SkipSample("image_too_long", f"the image alone needs {image_end} tokens, more than "
                                 f"seq_length={self.seq_length}; lower max_pixels or raise train.seq_length")
            ids, mask = ids[: self.seq_length], mask[: self.seq_length]
            mask[-1] = 0.0  # its label (the next token) was cut off
            if not any(mask):
                raise SkipSample("no_answer_left", f"truncated to seq_length={self.seq_length}, no answer token is left")
            self.truncated += 1
            log.warning("cord_v2 %s sample %d truncated to seq_length=%d (%d truncated so far)",
                        self.split, index, self.seq_length, self.truncated)
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        labels[:-1] = input_ids[1:]
        grid_thw = grid[None]
        return {
            "input_ids": input_ids,
            "labels": labels,
            "loss_mask": torch.tensor(mask, dtype=torch.float32),
            "position_ids": self.position_ids(input_ids, grid_thw, self.ids["image_token_id"], self.merge),
            "pixel_values": pixel_values,
            "image_grid_thw": grid_thw,
            "index": index,
        }
