"""Seeding every random stream a run draws from, for the trainer, the tools and the tests alike."""

from __future__ import annotations

import torch


def seed_everything(seed: int) -> None:
    """Seed Python, torch and megatron's model-parallel RNG streams."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On CPU the tracker is our CpuRngStatesTracker (multimodal/platform.py apply_cpu_patches).
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
