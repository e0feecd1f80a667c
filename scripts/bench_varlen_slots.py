"""What empty segment slots cost the packed attention kernels, flash varlen and cuDNN's THD (GPU).

    python scripts/bench_varlen_slots.py [--backends varlen cudnn] [--json OUT]

Why: a CUDA graph replays fixed shapes, so the graphed layers pass ``cu_seqlens`` padded with
empty segments up to a fixed slot count and ``max_seqlen`` fixed at the row length. The varlen
grid has a block for every (query tile, segment slot, head), and each empty slot's blocks still
start and exit. This times one attention forward + backward (``models.common.attention``,
``backend="varlen"`` and ``"cudnn"``) on a vision row of four images (17,492 patches in an 18,432-row bucket, 16
heads of 64) and 8K causal decoder rows (8 query / 2 k/v heads of 256), under each padding; the
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


def forward_backward_ms(lengths, rows, slots, max_seqlen, heads, head_dim, causal, backend="varlen", reps=20,
                        kv_heads=None) -> float:
    rows = rows if slots else sum(lengths)
    cu = cu_seqlens(lengths, rows, slots)
    q, k, v = (torch.randn(rows, h, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (heads, kv_heads or heads, kv_heads or heads))

    def once():
        out = attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=max_seqlen, backend=backend)
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
    ap.add_argument("--backends", nargs="+", default=["varlen", "cudnn"], choices=["varlen", "cudnn"])
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
    decoder = {
        "decoder 8K causal, one sample, 66 segments": ([8192], 8192, 66, 8192),
        "decoder 8K causal, one sample, exact": ([8192], 8192, 0, 8192),
        "decoder 8K causal, three samples, 17 segments": ([4096, 2560, 1536], 8192, 17, 8192),
    }
    result = {}
    for backend in args.backends:
        for name, c in cases.items():
            result.setdefault(name, {})[backend] = forward_backward_ms(*c, 16, 64, False, backend)
        for name, c in decoder.items():  # the 2B decoder's attention: 8 query heads, 2 k/v heads of 256
            result.setdefault(name, {})[backend] = forward_backward_ms(*c, 8, 256, True, backend, kv_heads=2)
    for name, by_backend in result.items():
        print("  ".join(f"{b} {ms:7.3f} ms" for b, ms in by_backend.items()) + f"  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                                               "cudnn": torch.backends.cudnn.version(),
                                               "forward_backward_ms": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
