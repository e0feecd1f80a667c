"""The zigzag context-parallel token layout: every packed sample is cut into ``2*cp`` equal
chunks and CP rank r keeps chunks r and 2*cp-1-r (multimodal/context_parallel.py explains why).

Shared by the trainer's batch split (``multimodal.context_parallel.partition_batch``) and the
fused MRoPE kernel's reference (``fused_kernels.fused_mrope.zigzag_global_index``), which must agree
on the layout; fused_kernels/ imports nothing above core, so the layout lives here.
"""

from __future__ import annotations

import torch


def zigzag_indices(segments: list[int], cp: int, rank: int) -> torch.Tensor:
    """Global token indices rank ``rank`` keeps, in its local order, for consecutive segments."""
    parts, start = [], 0
    for length in segments:
        if length % (2 * cp):
            raise ValueError(
                f"a packed segment of {length} tokens cannot be split into 2*cp = {2 * cp} chunks; "
                f"the collate must pad every sample to a multiple of {2 * cp}"
            )
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
