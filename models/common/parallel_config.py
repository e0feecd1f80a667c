"""The recipe's ``parallel`` section: the parallel layout. The model builder reads tp, pp, vpp, cp,
ep, the uneven stage sizes, sequence_parallel and moe_a2a_overlap; the trainer the rest. It lives
below the trainer (multimodal/config.py composes it into the recipe) so that model code can build a
layout itself.

Pipeline: ``pp`` ranks, each holding ``vpp`` model chunks (virtual stages) run by megatron-core's
interleaved 1F1B schedule. Chunk v of rank r is virtual stage ``v * pp + r``: the decoder's layers
go round the ranks ``vpp`` times. The first rank's first chunk carries the vision encoder and the
embedding, the last rank's last chunk the final norm, the LM head, MTP and the loss.
``first_stage_layers`` / ``last_stage_layers`` (megatron's ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage``) give the first / last rank fewer (or more) decoder layers
than the others, e.g. to make room for the vision tower; each rank's layers are split evenly over
its chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    # virtual pipeline stages (model chunks) per pipeline rank; > 1 selects the interleaved schedule
    vpp: int = 1
    # decoder layers of the first / last pipeline rank (all its chunks together); None: an even split
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
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

    def check_pipeline(self, num_layers: int, num_microbatches: int | None = None) -> None:
        """The pipeline rules, each refusal one line naming the field and the fix
        (``num_microbatches``: per step per data-parallel rank, when known)."""
        pp, vpp, first, last = self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers
        _require(vpp >= 1, f"parallel.vpp must be >= 1, got {vpp}")
        _require(vpp == 1 or pp > 1, f"parallel.vpp={vpp} splits each pipeline rank into chunks: it needs "
                                     f"parallel.pp > 1 (got {pp}); set parallel.vpp=1")
        uneven = first is not None or last is not None
        _require(not uneven or pp > 1, "parallel.first_stage_layers / last_stage_layers size pipeline stages: "
                                       "they need parallel.pp > 1; unset them")
        for name, n in (("first_stage_layers", first), ("last_stage_layers", last)):
            _require(n is None or (n >= vpp and n % vpp == 0),
                     f"parallel.{name} ({n}) must be a positive multiple of parallel.vpp ({vpp}): each of the "
                     "rank's chunks holds an equal share of at least one layer")
        middle_ranks = pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if pp > 1 and not uneven:
            _require(num_layers % (pp * vpp) == 0,
                     f"model.num_layers ({num_layers}) must be divisible by parallel.pp x parallel.vpp "
                     f"({pp} x {vpp}): every model chunk gets num_layers/(pp*vpp) decoder layers; choose pp/vpp "
                     "that divide it, or size the ends with parallel.first_stage_layers / last_stage_layers")
        elif uneven:
            _require(middle_layers >= 0 and (middle_ranks > 0 or middle_layers == 0),
                     f"parallel.first_stage_layers + last_stage_layers ({(first or 0) + (last or 0)}) must leave the "
                     f"{middle_ranks} other pipeline rank(s) the rest of model.num_layers ({num_layers})")
            _require(middle_ranks == 0 or (middle_layers % (middle_ranks * vpp) == 0
                                           and middle_layers >= middle_ranks * vpp),
                     f"the {middle_layers} decoder layers left after parallel.first_stage_layers / last_stage_layers "
                     f"must split evenly over the other {middle_ranks} rank(s) x parallel.vpp ({vpp}) chunks, "
                     "at least one each; change the end stages' sizes")
        if vpp > 1 and num_microbatches is not None:
            # megatron's interleaved schedule runs each chunk on groups of pp micro-batches in turn
            _require(num_microbatches >= pp and num_microbatches % pp == 0,
                     f"parallel.vpp > 1 needs a multiple of parallel.pp ({pp}) micro-batches per step per "
                     f"data-parallel rank (got {num_microbatches}); raise train.global_batch_size")

    def chunk_layers(self, num_layers: int) -> list[list[range]]:
        """Global decoder-layer indices of every chunk: ``[rank][vp_stage] -> range``, megatron's split
        (checked against get_transformer_layer_offset / get_num_layers_to_build in tests)."""
        pp, vpp = self.pp, self.vpp
        first = self.first_stage_layers if pp > 1 else None
        last = self.last_stage_layers if pp > 1 else None
        middle_ranks = pp - (first is not None) - (last is not None)
        middle = (num_layers - (first or 0) - (last or 0)) // max(middle_ranks, 1)
        per_rank = [middle] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        out, start = [[None] * vpp for _ in range(pp)], 0
        for v in range(vpp):  # virtual stage v * pp + r: the layers go round the ranks vpp times
            for r in range(pp):
                n = per_rank[r] // vpp
                out[r][v] = range(start, start + n)
                start += n
        return out


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)
