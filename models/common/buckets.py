"""Geometric size buckets: few distinct sizes for inputs of every size, at bounded padding.

Shared by the vision encoder's CUDA-graph buckets (models/qwen35_vl/vision_graphs.py) and the
``max_seqlen`` bounds of cuDNN's packed attention plans (models/common/attention.py).
"""

from __future__ import annotations

STEPS_PER_DOUBLING = 8


def bucket_rows(n: int, unit: int) -> int:
    """``n`` rounded up to the next multiple of ``unit`` up to ``8 * unit``; above, to the next of
    eight evenly spaced sizes per doubling (8..16 units in steps of 1, 16..32 in steps of 2, ...),
    so at most 1/8 of a bucket (above 8 units) is padding, and sizes from a to b need about
    8 * log2(b / a) buckets."""
    units = max(1, -(-n // unit))
    step = max(1, 2 ** (units.bit_length() - 1) // STEPS_PER_DOUBLING)
    return -(-units // step) * step * unit
