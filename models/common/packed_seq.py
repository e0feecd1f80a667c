"""What the model's layers learn about a packed micro-batch: megatron's ``PackedSeqParams`` plus
metadata built once on the host (``PackedRowParams``) and, under context parallelism, the
head-parallel exchange's orders (``CPPackedSeqParams``).

megatron-core passes these through every layer untouched (so recompute and pipeline schedules
see the right batch). The trainer fills them (multimodal/forward_step.py, with the batch split
of multimodal/context_parallel.py); the mixers read them (models/common/cp_collectives.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedRowParams(PackedSeqParams):
    """megatron's PackedSeqParams plus per-micro-batch metadata built once on the host, so that no
    layer rebuilds it on the device (nor syncs to do so): the family's sequence mixers' varlen
    metadata (``mixer_varlen``, from the family's ``packed_row_extras``; Qwen3.5: the GDN chunk table;
    None: the layers derive it themselves) and the loss tokens for the sparse LM head."""

    mixer_varlen: object | None = None
    # flat indices (s * B + b over this rank's [S, B] tokens) of the tokens with a nonzero loss
    # mask, for model.sparse_lm_head; None: the LM head runs on every token
    loss_token_index: torch.Tensor | None = None
    # True for the CUDA graphs' fixed-shape metadata (models/performance/layer_graphs.StaticBatch):
    # cu_seqlens padded with empty segments, max_seqlen_q the row length (an upper bound)
    static_shape: bool = False

    def one_segment(self, tokens: int) -> bool:
        """Whether this row of ``tokens`` tokens is a single sample, known on the host: its longest
        segment is the whole row. Never for static-shape metadata, whose max_seqlen is a bound."""
        return not self.static_shape and self.max_seqlen_q == tokens


def segment_boundaries(params: PackedSeqParams) -> torch.Tensor:
    """The cumulative token offsets of a packed row's samples as the kernels must see them: the
    padded ones (each sample padded for CP or for the GDN chunk size) when given, else the real ones."""
    cu = params.cu_seqlens_q_padded
    return params.cu_seqlens_q if cu is None else cu


@dataclass
class CPPackedSeqParams(PackedRowParams):
    """PackedSeqParams plus what the head-parallel mixers need under context parallelism.

    ``cu_seqlens_*_padded`` and ``max_seqlen_*`` describe the *whole* (gathered) sequence.
    gather_order[j] is the global token index of the j-th row of the all-to-all output
    (rank 0's local tokens, then rank 1's, ...); restore_order is its inverse permutation.
    For BSHD batches ``qkv_format`` is "sbhd" and the orders apply to every row.
    """

    cp_size: int = 1
    cp_rank: int = 0
    cp_mixer_group: dist.ProcessGroup | None = None
    gather_order: torch.Tensor | None = None
    restore_order: torch.Tensor | None = None


def cp_info(packed_seq_params) -> CPPackedSeqParams | None:
    if isinstance(packed_seq_params, CPPackedSeqParams) and packed_seq_params.cp_size > 1:
        return packed_seq_params
    return None
