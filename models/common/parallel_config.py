"""The recipe's ``parallel`` section: the parallel layout. The model builder reads tp, pp, cp, ep,
sequence_parallel and moe_a2a_overlap; the trainer the rest. It lives below the trainer
(multimodal/config.py composes it into the recipe) so that model code can build a layout itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    # GPUs the layout is designed for (nodes x GPUs per node); only --dry-run reads it, training
    # takes the real count from torchrun's WORLD_SIZE. None: the smallest world the layout fits.
    world_size: int | None = None
    # context parallel: each CP rank encodes only its share of the micro-batch's images (whole
    # images, balanced by patches) and the features are all-gathered; false: every CP rank
    # encodes every image (no collective, duplicated vision compute)
    cp_split_vision: bool = False
    # MoE: hide the expert-parallel all-to-all (dispatch / combine) behind another micro-batch's
    # compute with megatron-core's combined 1F1B schedule (models/common/schedule_plan.py). Needs
    # ep > 1, the alltoall dispatcher, bf16, pp = 1, a GPU, and >= 2 micro-batches per step to
    # overlap anything (one micro-batch runs, just without overlap).
    moe_a2a_overlap: bool = False
