"""Data-loader throughput on this machine: samples/s and packed rows (micro-batches)/s.

    python scripts/bench_loader.py --config configs/qwen35_vl_2b.yaml [--rows 20] [--workers N] [key=value ...]

Runs the recipe's dataset + collate in this process (no model, no GPU) and prints one JSON line.
Compare ``row_s`` with the GPU step time to see whether the loader keeps ahead of training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.loader import MicroBatchIterator, build_dataset  # noqa: E402
from multimodal.config import load_config, resolve_sources  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--workers", type=int, default=None, help="data.num_workers (default: the recipe's)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = resolve_sources(load_config(args.config, args.overrides))
    if args.workers is not None:
        cfg.data.num_workers = args.workers
    m, t = cfg.model, cfg.train
    ds = build_dataset(m, cfg.data, t.seq_length)
    it = MicroBatchIterator(ds, t.seq_length, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size,
                            cfg.data.pack, t.micro_batch_size, 0, 1, max_bad_fraction=cfg.data.max_bad_fraction,
                            num_workers=cfg.data.num_workers, pack_lookahead=cfg.data.pack_lookahead)
    next(it)  # warm-up (imports, first file reads)
    start_seen, start = it.seen, time.perf_counter()
    tokens = 0
    for _ in range(args.rows):
        tokens += next(it)["num_real_tokens"]
    elapsed = time.perf_counter() - start
    print(json.dumps({
        "config": args.config, "data": cfg.data.name, "seq_length": t.seq_length, "rows": args.rows,
        "samples_per_s": (it.seen - start_seen) / elapsed, "rows_per_s": args.rows / elapsed,
        "row_s": elapsed / args.rows, "real_tokens_per_s": tokens / elapsed, "workers": cfg.data.num_workers,
        # real (non-pad) share of the packed rows' tokens
        "pack_fill": tokens / (args.rows * t.seq_length) if cfg.data.pack else None,
        "pack_lookahead": cfg.data.pack_lookahead,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
