"""Your own conversations (``data.name=conversations``): records -> samples.

Records come from a ``.jsonl`` / ``.json`` file or a Hugging Face ``datasets`` folder (arrow or
parquet files), one record at a time (``data/record_sources.py``), in two forms:

- chat messages (what ``apply_chat_template`` takes)::

    {"messages": [{"role": "system" | "user" | "assistant" | "tool",
                   "content": "text" | [{"type": "image", "image": IMAGE}, {"type": "video", "video": VIDEO},
                                        {"type": "text", "text": "..."}],
                   "reasoning_content": "..." (optional),
                   "tool_calls": [{"name": ..., "arguments": {...} | "JSON"}, ...] (optional, assistant)}],
     "tools": [FUNCTION SCHEMA, ...] | "JSON list" (optional)}

  ``tools`` are written into the system turn, ``tool_calls`` after the assistant's answer and
  ``tool`` messages (the results) as ``<tool_response>`` blocks of a user turn, as Qwen3.5's
  template writes them (``data/chat.py``); calls are supervised, results are not.

- LLaVA / ShareGPT::

    {"image": IMAGE | [IMAGE, ...], "system": "..." (optional),
     "conversations": [{"from": "human" | "gpt" | "system", "value": "<image>\\nWhat is this?"}, ...]}

  each ``<image>`` in a value is the next image of the record, in order; each ``<video>`` the next
  of ``"video": VIDEO`` / ``"videos": [VIDEO, ...]``.

``IMAGE`` is a path (relative to ``data.conversations.image_root``, default the data file's folder or the
datasets folder; ``file://`` allowed), embedded bytes as a ``data:image/...;base64,...`` URL, raw
bytes, or a ``datasets`` ``Image`` value (``{"bytes": ..., "path": ...}``). ``VIDEO`` is a video
file (a path as for images, or raw bytes; decoded with PyAV and sampled at ``data.video.fps``) or a
list of frames (``IMAGE`` each) taken as given at ``data.video.fps`` frames a second
(``data/video.py``). ``data.conversations.system_prompt``
is put first in records that have no system message. Every sample is rendered as Qwen3.5's chat
template renders it (``data/chat.py``) and every assistant turn is supervised.

A bad record is skipped, counted in ``self.skipped`` by reason and logged with its index, as in
``data/cord_v2.py``: ``bad_json``, ``bad_record`` (not one of the forms), ``unknown_role``,
``missing_image``, ``bad_image``, ``missing_video``, ``bad_video``, ``image_count_mismatch`` (``<image>`` tags vs images),
``video_count_mismatch``,
``empty_answer``, ``too_long`` (more than ``train.seq_length`` tokens; never cut, since a cut
conversation would teach a half answer).
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import re
from pathlib import Path

import torch

from data.chat import encode_conversation, is_video, special_token_ids
from data.cord_v2 import SkipSample
from data.image import image_patches, open_image, smart_resize
from data.record_sources import RecordSourceError, open_records
from data.video import frame_timestamps, decode_video, video_patches
from models import get_model_family

log = logging.getLogger(__name__)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
IMAGE_TAG, VIDEO_TAG = "<image>", "<video>"
_TAGS = re.compile(f"({IMAGE_TAG}|{VIDEO_TAG})")


def sharegpt_to_messages(record: dict) -> tuple[list[dict], list]:
    """A LLaVA/ShareGPT record -> (chat messages with image and video parts, its images in order).

    Each ``<image>`` tag takes the next of ``image``/``images``; each ``<video>`` tag the next of
    ``video`` (one video: a file, or a list of frames) / ``videos`` (a list of them)."""
    images = record.get("image") if record.get("image") is not None else record.get("images")
    images = [images] if isinstance(images, (str, bytes, dict)) else list(images or [])
    videos = [record["video"]] if record.get("video") is not None else list(record.get("videos") or [])
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise SkipSample("bad_record", "conversations is not a list")
    messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
    media = {IMAGE_TAG: ("image", images), VIDEO_TAG: ("video", videos)}
    used = {IMAGE_TAG: 0, VIDEO_TAG: 0}
    for i, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(turn.get("from") if isinstance(turn, dict) else None)
        if role is None:
            raise SkipSample("unknown_role", f"turn {i} is from {turn.get('from') if isinstance(turn, dict) else turn!r}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise SkipSample("bad_record", f"turn {i} has no string value")
        pieces = _TAGS.split(value)  # text, tag, text, tag, ..., text
        parts = []
        for j, piece in enumerate(pieces):
            if j % 2:
                kind, sources = media[piece]
                k = used[piece]
                parts.append({"type": kind, kind: sources[k] if k < len(sources) else None})
                used[piece] += 1
            elif piece:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": role, "content": parts if any(used.values()) else value})
    for tag, (kind, sources) in media.items():
        if used[tag] != len(sources):
            raise SkipSample(f"{kind}_count_mismatch", f"{used[tag]} {tag} tag(s) but {len(sources)} {kind}(s)")
    return messages, images


def _without_nulls(d: dict) -> dict:
    """``d`` without its None values: a datasets table gives every struct the union of all
    records' keys (a text part gets ``"image": None``)."""
    return {k: v for k, v in d.items() if v is not None}


def _call_without_nulls(call):
    """A tool call without the None values a datasets table adds, at both of its levels (OpenAI's
    ``{"function": {...}}`` form)."""
    if not isinstance(call, dict):
        return call
    call = _without_nulls(call)
    if isinstance(call.get("function"), dict):
        call["function"] = _without_nulls(call["function"])
    return call


class ConversationsDataset(torch.utils.data.Dataset):
    """JSON/JSONL conversation records -> ``MockDataset``-format samples (or ``None`` when skipped)."""

    def __init__(self, model_cfg, data_cfg, seq_length: int, tokenizer, records=None):
        """``records``: any sized, indexable source of records (data/energon.py's shards); None: data.path's."""
        path = Path(data_cfg.path or "")
        try:
            self.records = open_records(path) if records is None else records
        except RecordSourceError as e:
            raise RecordSourceError(f"data.path={data_cfg.path!r}: {e}") from None
        self.path = path
        root = data_cfg.conversations.image_root
        self.image_root = Path(root) if root else path if path.is_dir() else path.parent
        self.system_prompt = data_cfg.conversations.system_prompt
        v = model_cfg.vision
        self.patch, self.tp, self.merge = v.patch_size, v.temporal_patch_size, v.spatial_merge_size
        family = get_model_family(model_cfg.name)
        self.position_ids = family.position_ids  # e.g. MRoPE's 3-D ids
        self.video_position_grids = family.video_position_grids  # e.g. a run per temporal group
        self.min_pixels, self.max_pixels = data_cfg.min_pixels, data_cfg.max_pixels
        self.image_mean, self.image_std = tuple(data_cfg.image_mean), tuple(data_cfg.image_std)
        video = data_cfg.video
        self.video_fps, self.video_frames = video.fps, (video.min_frames, video.max_frames)
        self.video_pixels = (video.min_pixels, video.max_pixels)
        self.seq_length, self.tokenizer = seq_length, tokenizer
        self.ids = special_token_ids(tokenizer)
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if key in self.ids and getattr(model_cfg, key) != self.ids[key]:
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
        """Chat messages (images and videos as bare parts) and their sources in order, as
        ("image" | "video", source) pairs."""
        if "messages" in record:
            messages = []
            if not isinstance(record["messages"], list):
                raise SkipSample("bad_record", "messages is not a list")
            for i, msg in enumerate(record["messages"]):
                if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "tool"):
                    role = msg.get("role") if isinstance(msg, dict) else msg
                    raise SkipSample("unknown_role", f"message {i} has role {role!r}; expected system, user, "
                                     "assistant or tool")
                msg = _without_nulls(msg)
                if isinstance(msg.get("tool_calls"), list):
                    msg["tool_calls"] = [_call_without_nulls(c) for c in msg["tool_calls"]]
                messages.append(msg)
        elif "conversations" in record:
            messages, _ = sharegpt_to_messages(record)
        else:
            raise SkipSample("bad_record", "a record needs 'messages' (chat form) or 'conversations' (LLaVA/ShareGPT form)")
        sources, out = [], []
        for msg in messages:
            content = msg.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    part = _without_nulls(part) if isinstance(part, dict) else part
                    if isinstance(part, dict) and (part.get("type") == "image" or "image" in part or "image_url" in part):
                        src = part.get("image", part.get("image_url"))
                        # {"url": ...}: the OpenAI image_url form; {"bytes", "path"}: a datasets Image
                        sources.append(("image", src["url"] if isinstance(src, dict) and "url" in src else src))
                        part = {"type": "image"}
                    elif isinstance(part, dict) and is_video(part):
                        sources.append(("video", part.get("video")))
                        part = {"type": "video"}
                    parts.append(part)
                msg = {**msg, "content": parts}
            out.append(msg)
        if self.system_prompt and not (out and out[0].get("role") == "system"):
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out, sources

    @staticmethod
    def _tools(record: dict) -> list | None:
        """The record's function schemas: a list, or a JSON string of one (a datasets table stores
        schemas of different shapes that way)."""
        tools = record.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except ValueError as e:
                raise SkipSample("bad_record", f"tools is not JSON ({e})") from None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise SkipSample("bad_record", "tools must be a list of function schemas (JSON objects)")
        return tools

    def _image_source(self, src, kind: str = "image"):
        """An image/video reference -> bytes or an existing path (or a counted skip)."""
        if isinstance(src, dict):  # a datasets Image feature: its bytes, else its path
            src = src.get("bytes") or src.get("path")
        if isinstance(src, (bytes, bytearray)) and src:
            return bytes(src)
        if not isinstance(src, str) or not src:
            raise SkipSample(f"missing_{kind}", f"{kind} reference {src!r} is neither a path, bytes nor a data URL")
        if src.startswith("data:"):
            try:
                return base64.b64decode(src.split(",", 1)[1], validate=True)
            except (IndexError, ValueError) as e:
                raise SkipSample(f"bad_{kind}", f"embedded {kind} is not base64 ({e})") from None
        path = Path(src.removeprefix("file://"))
        path = path if path.is_absolute() else self.image_root / path
        if not path.is_file():
            raise SkipSample(f"missing_{kind}", f"{kind} {path} does not exist (data.conversations.image_root={self.image_root})")
        return path

    def _load_image(self, src) -> tuple[torch.Tensor, torch.Tensor]:
        source = self._image_source(src)
        try:
            img = open_image(source)
            smart_resize(img.height, img.width, self.patch * self.merge, self.min_pixels, self.max_pixels)
        except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
            raise SkipSample("bad_image", f"image does not decode ({type(e).__name__}: {e})") from None
        return image_patches(img, self.patch, self.tp, self.merge, self.min_pixels, self.max_pixels,
                             self.image_mean, self.image_std)

    def _load_video(self, src) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """(pixel_values, grid_thw, timestamp of each temporal group) of a video file or frame list."""
        import numpy as np

        tp = self.tp
        try:
            if isinstance(src, (list, tuple)):  # frames, as given, at video_fps
                frames = [self._image_source(f, "video") for f in src]
                frames = [torch.from_numpy(np.asarray(open_image(f))).permute(2, 0, 1) for f in frames]
                if len({f.shape for f in frames}) > 1:
                    raise SkipSample("bad_video", f"its frames differ in size: {sorted({tuple(f.shape) for f in frames})}")
                video, indices, fps = torch.stack(frames), range(len(frames)), self.video_fps
            else:
                video, indices, fps = decode_video(self._image_source(src, "video"), self.video_fps, *self.video_frames)
            pixel_values, grid = video_patches(video, self.patch, tp, self.merge, *self.video_pixels,
                                               self.image_mean, self.image_std)
        except SkipSample:
            raise
        except Exception as e:  # PyAV and PIL raise many kinds; too few frames is a ValueError
            raise SkipSample("bad_video", f"video does not decode ({type(e).__name__}: {e})") from None
        return pixel_values, grid, frame_timestamps(indices, fps, tp)

    # ------------------------------------------------------------------ sample

    def _sample(self, index: int) -> dict:
        record = self._record(index)
        messages, sources = self._messages(record)
        tools = self._tools(record)
        answers = [m for m in messages if m.get("role") == "assistant"]
        if not answers:
            raise SkipSample("empty_answer", "the record has no assistant turn")
        for m in answers:
            c = m.get("content")
            text = c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [] if isinstance(p, dict))
            if not text.strip() and not (m.get("reasoning_content") or "").strip() and not m.get("tool_calls"):
                raise SkipSample("empty_answer", "an assistant turn is empty")
        visuals = [(kind, *(self._load_image(src) if kind == "image" else self._load_video(src)))
                   for kind, src in sources]
        counts = [int(v[2].prod()) // self.merge**2 for v in visuals if v[0] == "image"]
        videos = [(v[3], int(v[2][1:].prod()) // self.merge**2) for v in visuals if v[0] == "video"]
        try:
            ids, mask = encode_conversation(self.tokenizer, messages, counts, self.ids, videos, tools)
        except ValueError as e:
            raise SkipSample("bad_record", str(e)) from None
        if len(ids) > self.seq_length:
            raise SkipSample("too_long", f"{len(ids)} tokens, more than seq_length={self.seq_length}; lower "
                             "data.max_pixels or raise train.seq_length")
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        labels[:-1] = input_ids[1:]
        dim = 3 * self.tp * self.patch**2
        none = torch.zeros(0, 3, dtype=torch.long)
        # every image and video, in the order they appear: what the vision encoder reads
        grids = torch.stack([v[2] for v in visuals]) if visuals else none
        # the runs of vision tokens MRoPE places: a video's temporal groups are separate runs
        runs = [v[2][None] if v[0] == "image" else self.video_position_grids(v[2]) for v in visuals]
        vision_ids = tuple(self.ids[k] for k in ("image_token_id", "video_token_id") if k in self.ids)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "loss_mask": torch.tensor(mask, dtype=torch.float32),
            "position_ids": self.position_ids(input_ids, torch.cat(runs) if runs else none, vision_ids, self.merge),
            "pixel_values": torch.cat([v[1] for v in visuals]) if visuals else torch.zeros(0, dim),
            "image_grid_thw": grids,
            "video_grid_thw": torch.stack([v[2] for v in visuals if v[0] == "video"]) if videos else none,
            "index": index,
        }
