"""Photo-like JPEG/PNG files and a conversations data set that uses them, for loader and
training throughput on real image files (decode included) without downloading anything.

``write_photo_like_images`` draws smooth colour fields plus noise, so neither format compresses
a file to nothing and decoding costs what a photo of that size costs. ``write_image_conversations``
writes ``images/``, ``train.jsonl`` (the chat form of ``data.name=conversations``, 1 to
``max_images`` images a record) and a tiny Qwen-style ``tokenizer/`` beside them.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

_WORDS = ("total", "price", "item", "date", "invoice", "amount", "tax", "cash", "change", "receipt",
          "table", "figure", "page", "section", "name", "address", "number", "quantity")


def _draw(path: Path, h: int, w: int, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([xx / w, yy / h, (xx + yy) / (w + h)], -1) * 200
    img = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(path, **({"quality": 90} if path.suffix == ".jpg" else {}))


def write_photo_like_images(folder: str | Path, n: int, lo: int, hi: int, seed: int = 0,
                            processes: int = 1) -> list[Path]:
    """n files with sides uniform in [lo, hi], every other one a JPEG (quality 90) or a PNG."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        h, w = (int(x) for x in rng.integers(lo, hi + 1, size=2))
        jobs.append((folder / (f"{i}.jpg" if i % 2 == 0 else f"{i}.png"), h, w, seed * 1_000_003 + i))
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            list(pool.map(_draw, *zip(*jobs)))
    else:
        for job in jobs:
            _draw(*job)
    return [job[0] for job in jobs]


def write_image_conversations(out: str | Path, samples: int, lo: int, hi: int, max_images: int = 4,
                              seed: int = 0, processes: int = 1) -> Path:
    """Write out/{images/, train.jsonl, tokenizer/}; returns the JSONL's path. Each record has
    1..max_images of its own images, a question and a short answer of a few words."""
    from data.tiny_tokenizer import build_tiny_tokenizer

    out = Path(out)
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, max_images + 1, size=samples)
    paths = write_photo_like_images(out / "images", int(counts.sum()), lo, hi, seed, processes)
    lines, next_image = [], 0
    for i, count in enumerate(counts):
        rels = [p.relative_to(out).as_posix() for p in paths[next_image:next_image + int(count)]]
        next_image += int(count)
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(4, 24))))
        parts = [{"type": "image", "image": rel} for rel in rels]
        parts.append({"type": "text", "text": f"Question {i}: what do these pages show?"})
        lines.append(json.dumps({"messages": [{"role": "user", "content": parts},
                                              {"role": "assistant", "content": words}]}))
    path = out / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    build_tiny_tokenizer(out / "tokenizer")
    return path
