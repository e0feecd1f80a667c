"""Your own conversations (``data.name=conversations``): records -> samples.

Records come from a ``.jsonl`` / ``.json`` file or a Hugging Face ``datasets`` folder (arrow or
parquet files), one record at a time (``data/record_sources.py``), in two forms:

- chat messages (what ``apply_chat_template`` takes)::

    {"messages": [{"role": "system" | "user" | "assistant",
                   "content": "text" | [{"type": "image", "image": IMAGE}, {"type": "text", "text": "..."}],
                   "reasoning_content": "..." (optional)}]}

- LLaVA / ShareGPT::

    {"image": IMAGE | [IMAGE, ...], "system": "..." (optional),
     "conversations": [{"from": "human" | "gpt" | "system", "value": "<image>\\nWhat is this?"}, ...]}

  each ``<image>`` in a value is the next image of the record, in order.

``IMAGE`` is a path (relative to ``data.image_root``, default the data file's folder or the
datasets folder; ``file://`` allowed), embedded bytes as a ``data:image/...;base64,...`` URL, raw
bytes, or a ``datasets`` ``Image`` value (``{"bytes": ..., "path": ...}``). ``data.system_prompt``
is put first in records that have no system message. Every sample is rendered as Qwen3.5's chat
template renders it (``data/chat.py``) and every assistant turn is supervised.

A bad record is skipped, counted in ``self.skipped`` by reason and logged with its index, as in
``data/cord_v2.py``: ``bad_json``, ``bad_record`` (not one of the forms), ``unknown_role``,
``missing_image``, ``bad_image``, ``image_count_mismatch`` (``<image>`` tags vs images),
``empty_answer``, ``too_long`` (more than ``train.seq_length`` tokens; never cut, since a cut
conversation would teach a half answer).
"""

from __future__ import annotations

import base64
import collections
import logging
from pathlib import Path

import torch

from data.chat import encode_conversation, special_token_ids
from data.cord_v2 import SkipSample
from data.image import image_patches, open_image, smart_resize
from data.record_sources import RecordSourceError, open_records
from models import get_model_family

log = logging.getLogger(__name__)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
IMAGE_TAG = "<image>"


def sharegpt_to_messages(record: dict) -> tuple[list[dict], list]:
    """A LLaVA/ShareGPT record -> (chat messages with image parts, its images in order)."""
    images = record.get("image") if record.get("image") is not None else record.get("images")
    images = [images] if isinstance(images, (str, bytes, dict)) else list(images or [])
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise SkipSample("bad_record", "conversations is not a list")
    messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
    n_tags = 0
    for i, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(turn.get("from") if isinstance(turn, dict) else None)
        if role is None:
            raise SkipSample("unknown_role", f"turn {i} is from {turn.get('from') if isinstance(turn, dict) else turn!r}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise SkipSample("bad_record", f"turn {i} has no string value")
        pieces = value.split(IMAGE_TAG)
        parts = []
        for j, piece in enumerate(pieces):
            if j:
                parts.append({"type": "image", "image": images[n_tags] if n_tags < len(images) else None})
                n_tags += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": role, "content": parts if n_tags or len(pieces) > 1 else value})
    if n_tags != len(images):
        raise SkipSample("image_count_mismatch", f"{n_tags} {IMAGE_TAG} tag(s) but {len(images)} image(s)")
    return messages, images


def _without_nulls(d: dict) -> dict:
    """``d`` without its None values: a datasets table gives every struct the union of all
    records' keys (a text part gets ``"image": None``)."""
    return {k: v for k, v in d.items() if v is not None}


class ConversationsDataset(torch.utils.data.Dataset):
    """JSON/JSONL conversation records -> ``MockDataset``-format samples (or ``None`` when skipped)."""

    def __init__(self, model_cfg, data_cfg, seq_length: int, tokenizer):
        path = Path(data_cfg.path or "")
        try:
            self.records = open_records(path)
        except RecordSourceError as e:
            raise ValueError(f"data.path={data_cfg.path!r}: {e}") from None
        self.path = path
        self.image_root = Path(data_cfg.image_root) if data_cfg.image_root else path if path.is_dir() else path.parent
        self.system_prompt = data_cfg.system_prompt
        v = model_cfg.vision
        self.patch, self.tp, self.merge = v.patch_size, v.temporal_patch_size, v.spatial_merge_size
        self.position_ids = get_model_family(model_cfg.name).position_ids  # e.g. MRoPE's 3-D ids
        self.min_pixels, self.max_pixels = data_cfg.min_pixels, data_cfg.max_pixels
        self.image_mean, self.image_std = tuple(data_cfg.image_mean), tuple(data_cfg.image_std)
        self.seq_length, self.tokenizer = seq_length, tokenizer
        self.ids = special_token_ids(tokenizer)
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if getattr(model_cfg, key) != self.ids[key]:
                raise ValueError(f"model.{key}={getattr(model_cfg, key)} but the tokenizer's id is {self.ids[key]}; "
                                 f"set model.{key}={self.ids[key]}")
        self.skipped: collections.Counter = collections.Counter()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict | None:
        index = int(index)
        try:
            return self._sample(index)
        except SkipSample as e:
            self.skipped[e.reason] += 1
            log.warning("conversations %s record %d skipped (%s): %s", self.path.name, index, e.reason, e)
            return None

    # ------------------------------------------------------------------ pieces

    def _record(self, index: int) -> dict:
        record = self.records[index]
        if not isinstance(record, dict):
            raise SkipSample("bad_record", f"a record must be a JSON object, got {type(record).__name__}")
        return record

    def _messages(self, record: dict) -> tuple[list[dict], list]:
        """Chat messages (images as bare parts) and the image sources in order."""
        if "messages" in record:
            messages, images = [], []
            if not isinstance(record["messages"], list):
                raise SkipSample("bad_record", "messages is not a list")
            for i, msg in enumerate(record["messages"]):
                if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant"):
                    role = msg.get("role") if isinstance(msg, dict) else msg
                    raise SkipSample("unknown_role", f"message {i} has role {role!r}")
                messages.append(_without_nulls(msg))
        elif "conversations" in record:
            messages, _ = sharegpt_to_messages(record)
        else:
            raise SkipSample("bad_record", "a record needs 'messages' (chat form) or 'conversations' (LLaVA/ShareGPT form)")
        images, out = [], []
        for msg in messages:
            content = msg.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    part = _without_nulls(part) if isinstance(part, dict) else part
                    if isinstance(part, dict) and (part.get("type") == "image" or "image" in part or "image_url" in part):
                        src = part.get("image", part.get("image_url"))
                        # {"url": ...}: the OpenAI image_url form; {"bytes", "path"}: a datasets Image
                        images.append(src["url"] if isinstance(src, dict) and "url" in src else src)
                        part = {"type": "image"}
                    parts.append(part)
                msg = {**msg, "content": parts}
            out.append(msg)
        if self.system_prompt and not (out and out[0].get("role") == "system"):
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out, images

    def _load_image(self, src) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(src, dict):  # a datasets Image feature: its bytes, else its path
            src = src.get("bytes") or src.get("path")
        if isinstance(src, (bytes, bytearray)) and src:
            source = bytes(src)
        elif not isinstance(src, str) or not src:
            raise SkipSample("missing_image", f"image reference {src!r} is neither a path, bytes nor a data URL")
        elif src.startswith("data:"):
            try:
                data = base64.b64decode(src.split(",", 1)[1], validate=True)
            except (IndexError, ValueError) as e:
                raise SkipSample("bad_image", f"embedded image is not base64 ({e})") from None
            source = data
        else:
            path = Path(src.removeprefix("file://"))
            path = path if path.is_absolute() else self.image_root / path
            if not path.is_file():
                raise SkipSample("missing_image", f"image {path} does not exist (data.image_root={self.image_root})")
            source = path
        try:
            img = open_image(source)
            smart_resize(img.height, img.width, self.patch * self.merge, self.min_pixels, self.max_pixels)
        except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
            raise SkipSample("bad_image", f"image does not decode ({type(e).__name__}: {e})") from None
        return image_patches(img, self.patch, self.tp, self.merge, self.min_pixels, self.max_pixels,
                             self.image_mean, self.image_std)

    # ------------------------------------------------------------------ sample

    def _sample(self, index: int) -> dict:
        messages, sources = self._messages(self._record(index))
        answers = [m for m in messages if m.get("role") == "assistant"]
        if not answers:
            raise SkipSample("empty_answer", "the record has no assistant turn")
        for m in answers:
            c = m.get("content")
            text = c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [] if isinstance(p, dict))
            if not text.strip() and not (m.get("reasoning_content") or "").strip():
                raise SkipSample("empty_answer", "an assistant turn is empty")
        images = [self._load_image(src) for src in sources]
        counts = [int(g.prod()) // self.merge**2 for _, g in images]
        try:
            ids, mask = encode_conversation(self.tokenizer, messages, counts, self.ids)
        except ValueError as e:
            raise SkipSample("bad_record", str(e)) from None
        if len(ids) > self.seq_length:
            raise SkipSample("too_long", f"{len(ids)} tokens, more than seq_length={self.seq_length}; lower "
                             "data.max_pixels or raise train.seq_length")
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        labels[:-1] = input_ids[1:]
        dim = 3 * self.tp * self.patch**2
        grids = torch.stack([g for _, g in images]) if images else torch.zeros(0, 3, dtype=torch.long)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "loss_mask": torch.tensor(mask, dtype=torch.float32),
            "position_ids": self.position_ids(input_ids, grids, self.ids["image_token_id"], self.merge),
            "pixel_values": torch.cat([p for p, _ in images]) if images else torch.zeros(0, dim),
            "image_grid_thw": grids,
            "index": index,
        }
