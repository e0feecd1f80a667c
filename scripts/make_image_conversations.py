"""Write a conversations data set of photo-like JPEG/PNG files and a tiny tokenizer (no network).

    python scripts/make_image_conversations.py --out data_cache/image_convs [--samples 200] \
        [--sides 224,1344] [--max-images 4] [--processes 8]

Then train or time on real files, decode included, e.g. the 2B recipe on one GPU:

    python scripts/bench_train.py --config configs/qwen35_vl_2b.yaml --skip-hf data.name=conversations \
        data.path=data_cache/image_convs/train.jsonl data.tokenizer=data_cache/image_convs/tokenizer

The model's special token ids are read from the tokenizer (``data.tokenizer``); the images keep
their sides inside the checkpoint's pixel range (``data.min_pixels`` / ``data.max_pixels``).
"""

from __future__ import annotations

import argparse
import sys

from data.synthetic_images import write_image_conversations


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data_cache/image_convs")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--sides", default="224,1344", help="min,max side in pixels")
    ap.add_argument("--max-images", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=1)
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.sides.split(","))
    print(write_image_conversations(args.out, args.samples, lo, hi, args.max_images, args.seed, args.processes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
