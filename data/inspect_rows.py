"""What the model will be trained on, sample by sample: the conversation with the supervised tokens
marked, runs of image tokens collapsed, token counts and image grids (or one JSON object per
sample). The command line that loads a recipe and prints them is multimodal/inspect_data.py:

    python -m multimodal.inspect_data --config configs/qwen35_vl_proxy_cord.yaml [key=value ...] --num 3 [--json]

Supervised tokens are the *labels* whose loss mask is 1 (labels are the inputs shifted left by
one), so this shows exactly what the loss sees.
"""

from __future__ import annotations

import json
import sys

from core.vision_tokens import vision_token_mask
from data.loader import load_tokenizer


def supervised_positions(sample) -> list[int]:
    """Token positions whose prediction is trained: t + 1 for every t with loss_mask[t] == 1."""
    return [t + 1 for t in sample["loss_mask"].nonzero().flatten().tolist()]


def decoder(m, data):
    """Token ids -> text: the tokenizer of ``data.tokenizer``, else (mock data) the ids themselves
    with the special tokens of the model section ``m`` named."""
    names = {m.image_token_id: "<|image_pad|>", m.video_token_id: "<|video_pad|>",
             m.vision_start_token_id: "<|vision_start|>",
             m.vision_end_token_id: "<|vision_end|>", m.im_start_token_id: "<|im_start|>",
             m.im_end_token_id: "<|im_end|>"}
    if data.tokenizer:
        tok = load_tokenizer(data)
        return lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return lambda ids: " ".join(names.get(i, str(i)) for i in ids) + " "  # mock data: ids


def render(sample, decode, image_token_id: int | tuple[int, ...], color: bool) -> str:
    """The sample's text, supervised tokens marked, each run of image (or video) tokens as ``<|image_pad|>xN``."""
    pad_ids = image_token_id if isinstance(image_token_id, tuple) else (image_token_id,)
    pads = dict(zip(pad_ids, ("<|image_pad|>", "<|video_pad|>")))
    ids = sample["input_ids"].tolist()
    sup = set(supervised_positions(sample))
    on, off = ("\033[1;32m", "\033[0m") if color else ("[[", "]]")
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and (j in sup) == (i in sup) and ((ids[j] == ids[i]) if ids[i] in pads else ids[j] not in pads):
            j += 1
        text = f"{pads[ids[i]]}x{j - i}" if ids[i] in pads else decode(ids[i:j])
        out.append(f"{on}{text}{off}" if i in sup else text)
        i = j
    return "".join(out)


def pixel_stats(sample) -> list[dict]:
    """Per image and video, in sequence order: its grid, patch count and the statistics of its
    normalised pixel values (over all, and per RGB channel), to compare with another processor's
    ``pixel_values`` without dumping them. Each patch row is laid out (channel, time, row, col),
    so its channel c is the row's c-th third."""
    out, start = [], 0
    for grid in sample["image_grid_thw"].reshape(-1, 3).tolist():
        n = grid[0] * grid[1] * grid[2]
        x = sample["pixel_values"][start:start + n].double()
        start += n
        channels = x.reshape(n, 3, -1).transpose(0, 1).reshape(3, -1)
        out.append({"grid_thw": grid, "patches": n, "mean": x.mean().item(), "std": x.std().item(),
                    "min": x.min().item(), "max": x.max().item(), "channel_mean": channels.mean(1).tolist()})
    return out


def describe(sample, decode, image_token_id: int | tuple[int, ...]) -> dict:
    labels_sup = [sample["input_ids"][p].item() for p in supervised_positions(sample)]
    return {
        "index": sample["index"],
        "num_tokens": len(sample["input_ids"]),
        "num_supervised": len(labels_sup),
        "supervised_text": decode(labels_sup),
        "num_image_tokens": int(vision_token_mask(sample["input_ids"], image_token_id).sum()),  # and video tokens
        "image_grid_thw": sample["image_grid_thw"].tolist(),  # every image and video, in order
        "video_grid_thw": sample.get("video_grid_thw", sample["image_grid_thw"][:0]).tolist(),
        "input_ids": sample["input_ids"].tolist(),  # to diff against your own processor's ids
        # loss_mask[t] weights the prediction of input_ids[t + 1] (labels are the inputs shifted left)
        "loss_mask": [int(v) for v in sample["loss_mask"].tolist()],
        "position_ids": sample["position_ids"].tolist(),  # [3][num_tokens] for MRoPE: (t, h, w)
        "pixel_stats": pixel_stats(sample),
    }


def print_samples(ds, decode, image_token_id: int | tuple[int, ...], num: int, start: int = 0,
                  as_json: bool = False) -> None:
    """Print the first ``num`` usable samples of ``ds`` from index ``start`` (text, or JSON lines)."""
    shown, index = 0, start
    while shown < num and index < len(ds):
        sample = ds[index]
        index += 1
        if sample is None:  # skipped (and counted) by the dataset
            continue
        shown += 1
        info = describe(sample, decode, image_token_id)
        if as_json:
            print(json.dumps(info, ensure_ascii=False))
            continue
        print(f"--- sample {info['index']}: {info['num_tokens']} tokens, {info['num_supervised']} supervised, "
              f"{info['num_image_tokens']} image tokens, grids {info['image_grid_thw']}")
        print(render(sample, decode, image_token_id, color=sys.stdout.isatty()))
    skipped = dict(getattr(ds, "skipped", {}) or {})
    if skipped and not as_json:
        print(f"--- skipped while reading: {skipped}")
