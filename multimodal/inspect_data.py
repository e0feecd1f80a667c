"""Look at what the model will be trained on.

    python -m multimodal.inspect_data --config configs/qwen35_vl_proxy_cord.yaml [key=value ...] --num 3 [--json]

Prints the first N usable samples of ``data.split`` in dataset order (``--start`` to begin
elsewhere): the conversation with the supervised tokens in [[double brackets]] (or colour on a
terminal), runs of image tokens collapsed, token counts and image grids. ``--json`` prints one
object per sample with ``index, num_tokens, num_supervised, supervised_text, num_image_tokens,
image_grid_thw, video_grid_thw, input_ids, loss_mask, position_ids, pixel_stats`` (data/inspect_rows.py). Supervised tokens are the *labels* whose loss mask is 1 (labels are the inputs
shifted left by one), so this shows exactly what the loss sees.

The rendering is data/inspect_rows.py's; this module adds the recipe (load, resolve, validate).
"""

from __future__ import annotations

import argparse
import sys

from core.errors import TrainingError
from data.inspect_rows import decoder, print_samples
from data.loader import build_dataset
from multimodal.config import ConfigError, load_config, resolve_sources, validate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--num", type=int, default=3)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        cfg = resolve_sources(load_config(args.config, args.overrides))
        validate(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        ds = build_dataset(cfg.model, cfg.data, cfg.train.seq_length)
        print_samples(ds, decoder(cfg.model, cfg.data), cfg.model.vision_token_ids, args.num, args.start, args.json)
    except TrainingError as e:  # files it cannot read at all: one line, as in training
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
