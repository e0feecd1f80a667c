"""The GDN varlen metadata the trainer builds once per micro-batch for flash-linear-attention."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from data.collate import pack_thd
from data.mock import MockDataset
from fused_kernels.gated_delta_rule import FLA_CHUNK_SIZE, chunk_indices_host
from models import get_model_family
from multimodal.config import load_config
from multimodal.forward_step import packed_seq_params, to_device


def test_chunk_table_lists_every_chunk_of_every_sample_in_order():
    # lengths 5, 65, 0 (an empty segment), 130 with 64-token chunks: 1, 2, 0 and 3 chunks
    cu = torch.tensor([0, 5, 70, 70, 200], dtype=torch.int32)
    table = chunk_indices_host(cu, 64)
    assert table.dtype == torch.long
    assert table.tolist() == [[0, 0], [1, 0], [1, 1], [3, 0], [3, 1], [3, 2]]
    assert chunk_indices_host(torch.tensor([0, 64, 128]), 64).tolist() == [[0, 0], [1, 0]]


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
def test_chunk_table_equals_the_one_fla_builds_itself():
    from fla.ops.utils.index import prepare_chunk_indices

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lens = torch.randint(0, 300, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        assert torch.equal(chunk_indices_host(cu.int(), FLA_CHUNK_SIZE), prepare_chunk_indices(cu, FLA_CHUNK_SIZE))


def test_forward_step_hands_every_gdn_layer_one_precomputed_table():
    cfg = load_config("configs/qwen35_vl_proxy.yaml")
    m = cfg.model
    ds = MockDataset(m, cfg.data, 512)
    batch = pack_thd([ds[0], ds[1], ds[2]], 512, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size)
    extras = get_model_family(m.name).packed_row_extras  # Qwen3.5's: the GDN chunk table
    params = packed_seq_params(to_device(batch, torch.device("cpu"), torch.float32, row_extras=extras))
    varlen = params.mixer_varlen
    assert varlen.cu_seqlens.dtype == torch.long
    assert torch.equal(varlen.cu_seqlens, batch["cu_seqlens_padded"].long())
    # the segments (three samples and the tail padding), chunk by chunk, counted here from their
    # lengths: (segment, chunk within it) for each FLA_CHUNK_SIZE tokens, a partial chunk included
    lens = (batch["cu_seqlens_padded"][1:] - batch["cu_seqlens_padded"][:-1]).tolist()
    assert len(lens) == 4
    want = [[s, j] for s, n in enumerate(lens) for j in range(-(-n // FLA_CHUNK_SIZE))]
    assert varlen.chunk_indices.tolist() == want
