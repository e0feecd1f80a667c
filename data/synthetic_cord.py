"""Write a small CORD-v2-shaped data set (parquet) with drawn receipts, for tests and smoke runs.

The real ``naver-clova-ix/cord-v2`` cannot be downloaded on the project's machines, so the
loader is tested on files of the same layout: per split, parquet shards named like
``train-00000-of-00002.parquet`` with the columns Hugging Face ``datasets`` writes,

* ``image``: struct ``{bytes: binary, path: string}`` (how ``datasets.Image`` is stored),
* ``ground_truth``: a JSON string ``{"gt_parse": {...}, "meta": {...}, "valid_line": []}``.

``gt_parse`` mimics CORD's: ``menu`` is a list of ``{"nm", "cnt", "price"}`` items (a bare
dict when there is one item, as in CORD), optional ``sub_total``, and ``total``. The image
shows the same lines, so a model could in principle learn the task.

With ``bad_rows=True`` the train split also gets one row of each failure the loader must
survive; ``write_synthetic_cord`` returns where they are and the skip reason expected.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

_ITEMS = ["Iced Americano", "Latte", "Croissant", "Nasi Goreng", "Mie Ayam", "Es Teh Manis",
          "Kopi Susu", "Roti Bakar", "Cheese Cake", "Green Tea", "Chicken Burger", "French Fries"]

# A minimal HF ``datasets`` features record, so the files also look right to ``datasets``.
_HF_META = {"info": {"features": {"image": {"_type": "Image"},
                                  "ground_truth": {"dtype": "string", "_type": "Value"}}}}


def _price(x: int) -> str:
    return f"{x:,}"  # CORD's Indonesian receipts: "12,000"


def _receipt(rng: np.random.Generator) -> tuple[dict, list[str]]:
    """A random gt_parse and the text lines that show it."""
    n = int(rng.integers(1, 5))
    menu, lines, sub = [], [], 0
    for name in rng.choice(_ITEMS, size=n, replace=False).tolist():
        cnt, unit = int(rng.integers(1, 4)), int(rng.integers(3, 40)) * 500
        sub += cnt * unit
        menu.append({"nm": name, "cnt": str(cnt), "price": _price(cnt * unit)})
        lines.append(f"{cnt} {name}  {_price(cnt * unit)}")
    gt: dict = {"menu": menu if n > 1 else menu[0]}
    if rng.random() < 0.5:
        gt["sub_total"] = {"subtotal_price": _price(sub)}
        lines.append(f"SUBTOTAL  {_price(sub)}")
    gt["total"] = {"total_price": _price(sub)}
    lines.append(f"TOTAL  {_price(sub)}")
    return gt, lines


def _draw(rng: np.random.Generator, lines: list[str]) -> tuple[bytes, int, int]:
    """A grey-ish receipt of random size with the lines in black; PNG bytes and its size."""
    from PIL import Image, ImageDraw

    w = int(rng.integers(120, 260))
    h = int(max(40 + 14 * len(lines), rng.integers(140, 320)))
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(215, 256, size=3)))
    draw = ImageDraw.Draw(img)
    y = 10
    for line in ["RECEIPT"] + lines:
        draw.text((6, y), line, fill=(0, 0, 0))
        y += 14
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), w, h


def _row(rng: np.random.Generator, split: str, i: int) -> tuple[dict, dict]:
    gt, lines = _receipt(rng)
    png, w, h = _draw(rng, lines)
    meta = {"version": "2.0.0", "split": split, "image_id": i, "image_size": {"width": w, "height": h}}
    return {"image": {"bytes": png, "path": None},
            "ground_truth": json.dumps({"gt_parse": gt, "meta": meta, "valid_line": []}, ensure_ascii=False)}, gt


def _bad_rows(rng: np.random.Generator) -> list[tuple[dict, str]]:
    """One row per failure kind, with the skip reason ``CordV2Dataset`` must count."""
    good, _ = _row(rng, "train", -1)
    return [
        ({"image": {"bytes": b"\x89PNG\r\n\x1a\nnot really a png", "path": None},
          "ground_truth": good["ground_truth"]}, "bad_image"),
        ({"image": good["image"], "ground_truth": '{"gt_parse": {"menu": [}'}, "bad_json"),
        ({"image": good["image"], "ground_truth": json.dumps({"gt_parse": {}, "meta": {}})}, "empty_answer"),
        ({"image": good["image"], "ground_truth": json.dumps({"meta": {}})}, "missing_field"),
        ({"image": None, "ground_truth": good["ground_truth"]}, "missing_field"),
    ]


def write_synthetic_cord(out_dir: str | Path, n_train: int = 8, n_val: int = 2, n_test: int = 2,
                         seed: int = 0, bad_rows: bool = False, shards: int = 2) -> dict:
    """Write ``{split}-XXXXX-of-YYYYY.parquet`` files into ``out_dir``; deterministic in ``seed``.

    Returns ``{"gt": {split: [gt_parse, ...]}, "bad": {row index in train: reason}}``; ``gt``
    holds ``None`` at bad rows. The train split is cut into ``shards`` files (when it has
    enough rows) so that multi-file reading is exercised.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                        ("ground_truth", pa.string())],
                       metadata={"huggingface": json.dumps(_HF_META)})
    manifest: dict = {"gt": {}, "bad": {}}
    for s, (split, n) in enumerate((("train", n_train), ("validation", n_val), ("test", n_test))):
        rng = np.random.default_rng((seed, s))
        rows, gts = [], []
        for i in range(n):
            row, gt = _row(rng, split, i)
            rows.append(row)
            gts.append(gt)
        if split == "train" and bad_rows:
            for row, reason in _bad_rows(rng):
                manifest["bad"][len(rows)] = reason
                rows.append(row)
                gts.append(None)
        manifest["gt"][split] = gts
        k = max(1, min(shards if split == "train" else 1, len(rows)))
        bounds = np.linspace(0, len(rows), k + 1).astype(int)
        for j in range(k):
            table = pa.Table.from_pylist(rows[bounds[j]:bounds[j + 1]], schema=schema)
            pq.write_table(table, out / f"{split}-{j:05d}-of-{k:05d}.parquet")
    return manifest
