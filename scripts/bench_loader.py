"""Data-loader throughput on this machine: samples/s and packed rows (micro-batches)/s.

    python scripts/bench_loader.py --config configs/qwen35_vl_2b.yaml [--rows 20] [--workers N] [key=value ...]
    python scripts/bench_loader.py --config configs/qwen35_vl_2b.yaml --images 200 [--sides 224,4000]

Runs the recipe's dataset + collate in this process (no model, no GPU) and prints one JSON line.
Compare ``row_s`` with the GPU step time to see whether the loader keeps ahead of training.

``--images N`` measures instead what one loader worker does per real image file: N JPEG and PNG
files (half each) of random sizes are written to a temporary folder, then each is decoded
(``data.image.open_image``) and resized and patchified at the recipe's ``data.min_pixels`` /
``data.max_pixels`` (``data.image.image_patches``), timed apart. Workers are processes, so the
loader's rate is about this one times ``data.loader.num_workers`` while cores last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from data.loader import MicroBatchIterator, build_dataset  # noqa: E402
from multimodal.config import load_config, resolve_sources  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--workers", type=int, default=None, help="data.loader.num_workers (default: the recipe's)")
    ap.add_argument("--images", type=int, default=0, help="time decode + resize of N real image files instead")
    ap.add_argument("--sides", default="224,4000", help="--images: min,max side in pixels")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = resolve_sources(load_config(args.config, args.overrides))
    if args.images:
        lo, hi = (int(x) for x in args.sides.split(","))
        print(json.dumps({"config": args.config, **image_file_rates(cfg, args.images, lo, hi)}))
        return 0
    if args.workers is not None:
        cfg.data.loader.num_workers = args.workers
    m, t = cfg.model, cfg.train
    ds = build_dataset(m, cfg.data, t.seq_length)
    it = MicroBatchIterator.from_config(ds, m, cfg.data, t)
    next(it)  # warm-up (imports, first file reads)
    start_seen, start = it.seen, time.perf_counter()
    tokens = 0
    for _ in range(args.rows):
        tokens += next(it)["num_real_tokens"]
    elapsed = time.perf_counter() - start
    print(json.dumps({
        "config": args.config, "data": cfg.data.name, "seq_length": t.seq_length, "rows": args.rows,
        "samples_per_s": (it.seen - start_seen) / elapsed, "rows_per_s": args.rows / elapsed,
        "row_s": elapsed / args.rows, "real_tokens_per_s": tokens / elapsed, "workers": cfg.data.loader.num_workers,
        # real (non-pad) share of the packed rows' tokens
        "pack_fill": tokens / (args.rows * t.seq_length) if cfg.data.pack else None,
        "pack_lookahead": cfg.data.loader.pack_lookahead,
    }))
    return 0


def image_file_rates(cfg, n: int, lo: int, hi: int) -> dict:
    import tempfile

    from data.image import image_patches, open_image
    from data.synthetic_images import write_photo_like_images

    v, d = cfg.model.vision, cfg.data
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_photo_like_images(tmp, n, lo, hi)
        decode = resize = 0.0
        patches = megapixels = 0
        for path in paths:
            t0 = time.perf_counter()
            img = open_image(str(path))
            t1 = time.perf_counter()
            pixels, _grid = image_patches(img, v.patch_size, v.temporal_patch_size, v.spatial_merge_size,
                                          d.min_pixels, d.max_pixels)
            resize += time.perf_counter() - t1
            decode += t1 - t0
            patches += pixels.shape[0]
            megapixels += img.width * img.height / 1e6
    total = decode + resize
    return {"images": n, "sides": [lo, hi], "min_pixels": d.min_pixels, "max_pixels": d.max_pixels,
            "images_per_s_per_worker": n / total, "patches_per_s_per_worker": patches / total,
            "decoded_megapixels_per_s": megapixels / decode, "decode_share": decode / total,
            "mean_patches_per_image": patches / n}


if __name__ == "__main__":
    sys.exit(main())
