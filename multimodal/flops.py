"""Training FLOPs of a step and the device peak, for tflops_per_gpu and MFU.

FLOPs count real tokens only (padding is free work, not credit); what is counted is the model
family's (``ModelFamily.training_flops``, e.g. models/qwen35_vl/flops.py). Here: the dispatch by
``model.name`` and the devices' dense bf16 peaks.
"""

from __future__ import annotations

from collections.abc import Iterable

from models import get_model_family


def training_flops(m, sample_lengths: Iterable[int], image_grids: Iterable[tuple[int, int, int]],
                   lm_head_tokens: int | None = None, mtp_head_tokens: int | None = None) -> float:
    """FLOPs of forward + backward for the given real samples of the model ``m`` (the recipe's
    ``model`` section). ``lm_head_tokens``: how many tokens the LM head ran on
    (``model.sparse_lm_head``: the loss tokens); None: every real token. ``mtp_head_tokens``: the
    same for the MTP depths, all together."""
    return get_model_family(m.name).training_flops(m, sample_lengths, image_grids, lm_head_tokens, mtp_head_tokens)


# Dense bf16 peak per device (TFLOP/s), for MFU. Override with logging.peak_tflops.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def device_peak_tflops(override: float | None = None) -> float | None:
    if override:
        return override
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None
