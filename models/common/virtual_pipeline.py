"""Model chunks for pipeline parallelism with virtual stages (``parallel.vpp``).

megatron-core's interleaved 1F1B schedule takes the model as a list of chunks, one per virtual
stage of this pipeline rank. Each chunk is a whole MultimodalModel that builds only its own decoder
layers (its global layer indices come from megatron's ``get_transformer_layer_offset(config,
vp_stage)``, so layer numbers and checkpoint keys are global and a checkpoint saved under one
VPP loads under another); the vision encoder and the embedding exist only on the first chunk of
the first rank, the final norm, LM head and MTP only on the last chunk of the last rank.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def megatron_pipeline(parallel) -> dict:
    """The TransformerConfig pipeline fields of a ``parallel`` section (any object with its fields)."""
    pp, vpp = parallel.pp, getattr(parallel, "vpp", 1)
    first, last = getattr(parallel, "first_stage_layers", None), getattr(parallel, "last_stage_layers", None)
    return dict(pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                num_layers_in_first_pipeline_stage=first if pp > 1 else None,
                num_layers_in_last_pipeline_stage=last if pp > 1 else None)


def chunk_layers(config, vp_stage: int | None = None, pp_rank: int | None = None) -> range:
    """Global indices of the decoder layers of this rank's chunk ``vp_stage`` (all layers at pp=1),
    by megatron's own offset and count, which also number the layers TransformerBlock builds."""
    if config.pipeline_model_parallel_size == 1:
        return range(config.num_layers)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def build_model_chunks(build, m, parallel, params_dtype, deterministic: bool = False) -> list:
    """This pipeline rank's model chunks: ``build`` (a family's builder) once per virtual stage,
    with the chunk's ``pre_process`` / ``post_process`` and ``vp_stage`` (None without virtual
    stages, as megatron expects). Needs megatron's parallel state set up with the same vpp."""
    vpp = getattr(parallel, "vpp", 1)
    have = ps.get_virtual_pipeline_model_parallel_world_size()
    if (have or 1) != vpp:
        raise ValueError(f"parallel.vpp={vpp} but megatron's parallel state has {have} virtual stages: "
                         "pass virtual_pipeline_model_parallel_size to initialize_model_parallel")
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        chunk = build(m, parallel, params_dtype,
                      pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                      post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                      deterministic=deterministic, vp_stage=vp_stage)
        chunk.vp_stage = vp_stage
        # forward_step: the last chunk records each micro-batch's stats for the step's counts, once
        chunk.counts_batches = v == vpp - 1
        chunks.append(chunk)
    return chunks


class ModelChunks(torch.nn.ModuleList):
    """A rank's model chunks seen as one module by checkpointing: ``sharded_state_dict`` is every
    chunk's, under ``<chunk index>.`` as ``state_dict`` names them, so ``load_state_dict`` takes
    the loaded dict back. The stored keys are megatron's global ones (global layer indices), the
    same under any vpp."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # the chunk index goes into the dict keys only: the stored (ShardedTensor) keys stay global
        out = {}
        for i, chunk in enumerate(self):
            for key, entry in chunk.sharded_state_dict(prefix, sharded_offsets, metadata).items():
                out[f"{i}.{key}"] = entry
        return out


def as_one_module(model):
    """A model, or a list of chunks (one chunk: itself; more: ModelChunks)."""
    if isinstance(model, (list, tuple)):
        return model[0] if len(model) == 1 else ModelChunks(model)
    return model
