"""Interleaved (virtual) pipeline parallelism: the layer split and the layout rules.

Training under PP=2 x VPP=2 x TP=2 x DP=2 against one process, its resume at PP=1 and the refusal
of a distributed-optimizer checkpoint under another layout: tests/test_parallel_8rank.py.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("num_layers,pp,vpp,first,last", [
    (8, 2, 2, None, None), (8, 4, 2, None, None), (12, 4, 2, 2, 2), (10, 2, 2, 4, None), (6, 3, 1, 1, 1),
    (14, 3, 2, 2, None), (60, 4, 5, 5, 15),
])
def test_chunk_layers_are_megatrons_split(num_layers, pp, vpp, first, last):
    """ParallelConfig.chunk_layers (what the dry run counts) is the split megatron builds and numbers
    its layers by (get_transformer_layer_offset / get_num_layers_to_build per rank and vp stage), and
    every layer lands in exactly one chunk."""
    import torch
    from megatron.core.transformer import TransformerConfig

    from models.common.parallel_config import ParallelConfig
    from models.common.virtual_pipeline import chunk_layers, megatron_pipeline

    p = ParallelConfig(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    p.check_pipeline(num_layers)
    tcfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                             pipeline_dtype=torch.float32, **megatron_pipeline(p))
    ours = p.chunk_layers(num_layers)
    for r in range(pp):
        for v in range(vpp):
            assert ours[r][v] == chunk_layers(tcfg, v if vpp > 1 else None, pp_rank=r), (r, v)
    assert sorted(i for rank in ours for chunk in rank for i in chunk) == list(range(num_layers))


@pytest.mark.parametrize("fields,num_layers,microbatches,fragment", [
    (dict(vpp=2), 4, 2, "needs parallel.pp > 1"),
    (dict(pp=2, vpp=4), 4, 2, "divisible by parallel.pp x parallel.vpp"),
    (dict(pp=2, vpp=2), 4, 3, "multiple of parallel.pp (2) micro-batches"),
    (dict(pp=2, vpp=2, first_stage_layers=1), 4, 2, "positive multiple of parallel.vpp"),
    (dict(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2), 14, 4, "split evenly over the other 2"),
    (dict(pp=2, first_stage_layers=3, last_stage_layers=3), 4, 2, "must leave the 0 other"),
    (dict(first_stage_layers=2), 4, 2, "need parallel.pp > 1"),
])
def test_bad_pipeline_layouts_are_refused_in_one_line(fields, num_layers, microbatches, fragment):
    from core.errors import ConfigError
    from models.common.parallel_config import ParallelConfig

    with pytest.raises(ConfigError, match=None) as err:
        ParallelConfig(**fields).check_pipeline(num_layers, microbatches)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)
