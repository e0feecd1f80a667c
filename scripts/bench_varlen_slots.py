"""What empty segment slots cost flash attention's varlen kernels (GPU).

    python scripts/bench_varlen_slots.py [--json OUT]

Why: a CUDA graph replays fixed shapes, so the graphed layers pass ``cu_seqlens`` padded with
empty segments up to a fixed slot count and ``max_seqlen`` fixed at the row length. The varlen
grid has a block for every (query tile, segment slot, head), and each empty slot's blocks still
start and exit. This times one attention forward + backward (``models.common.attention``,
``backend="varlen"``) on a vision row of four images (17,492 patches in an 18,432-row bucket, 16
heads of 64) and a one-sample 8K causal decoder row (8 heads of 256), under each padding; the
vision graphs' segment slots (``models/qwen35_vl/vision_graphs.py``, ``segment_slots``) follow
from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from models.common.attention import attention

VISION_IMAGES = [7056, 3600, 1936, 4900]  # patches of four images, 224-1344 px
VISION_ROWS = 18432  # their vision graph bucket


def cu_seqlens(lengths: list[int], rows: int, slots: int) -> torch.Tensor:
    """Offsets of ``lengths``, a padding segment up to ``rows``, then empty segments up to
    ``slots`` segments in all (0: no padding, exact). The graphs' layout for ``max_images``
    image slots has ``max_images + 1`` segments (the padding rows' own one)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if slots:
        if rows > cu[-1]:
            cu.append(rows)
        cu += [rows] * (slots + 1 - len(cu))
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def forward_backward_ms(lengths, rows, slots, max_seqlen, heads, head_dim, causal, reps=20) -> float:
    rows = rows if slots else sum(lengths)
    cu = cu_seqlens(lengths, rows, slots)
    q, k, v = (torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def once():
        out = attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=max_seqlen, backend="varlen")
        out.backward(torch.ones_like(out))

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_varlen_slots.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    cases = {  # name: (lengths, rows, segments in cu_seqlens (0: exact), max_seqlen)
        "vision, 66 segments, max_seqlen = rows (the graphs' layout for max_images=64)": (VISION_IMAGES, VISION_ROWS, 66, VISION_ROWS),
        "vision, 17 segments, max_seqlen = rows (the graphs' 16-slot layout)": (VISION_IMAGES, VISION_ROWS, 17, VISION_ROWS),
        "vision, 66 segments, max_seqlen = 8192": (VISION_IMAGES, VISION_ROWS, 66, 8192),
        "vision, 6 segments, max_seqlen = rows": (VISION_IMAGES, VISION_ROWS, 6, VISION_ROWS),
        "vision, 6 segments, max_seqlen = 8192": (VISION_IMAGES, VISION_ROWS, 6, 8192),
        "vision, exact (eager)": (VISION_IMAGES, VISION_ROWS, 0, max(VISION_IMAGES)),
    }
    result = {name: forward_backward_ms(*c, 16, 64, False) for name, c in cases.items()}
    result["decoder 8K causal, one sample, 66 segments"] = forward_backward_ms([8192], 8192, 66, 8192, 8, 256, True)
    result["decoder 8K causal, one sample, exact"] = forward_backward_ms([8192], 8192, 0, 8192, 8, 256, True)
    for name, ms in result.items():
        print(f"{ms:8.3f} ms  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                                               "forward_backward_ms": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
