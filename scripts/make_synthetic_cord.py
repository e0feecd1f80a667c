"""Write a synthetic CORD-v2 folder and a tiny Qwen-style tokenizer (no network needed).

    python scripts/make_synthetic_cord.py --out data_cache/synthetic_cord [--train 64]

Creates OUT/data/{train,validation,test}-*.parquet (the naver-clova-ix/cord-v2 layout) and
OUT/tokenizer/; configs/qwen35_vl_proxy_cord.yaml points at both. Point data.path and
data.tokenizer at the real data set and tokenizer to train on them instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from data.synthetic_cord import write_synthetic_cord  # noqa: E402
from data.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data_cache/synthetic_cord")
    ap.add_argument("--train", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    write_synthetic_cord(out / "data", n_train=args.train, n_val=8, n_test=8, seed=args.seed)
    build_tiny_tokenizer(out / "tokenizer")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
