"""The host-side planning around FlashQLA (kernels/flash_qla_gdr.py): the chunk tables and the
intra-card split it is handed. The kernels themselves need an SM90 GPU:
scripts/check_gdn_kernels_gpu.py runs them against fla and an fp32 reference."""

import torch

from kernels import flash_qla_gdr as qla
from kernels.gated_delta_rule import chunk_indices_host


def test_chunk_table_matches_the_fla_table_and_counts_partial_chunks():
    cu = [0, 100, 164, 164, 1000]  # a partial chunk, an exact chunk, an empty sample, a long one
    offsets, total, indices = qla._chunk_table(cu)
    assert offsets.tolist() == [0, 2, 3, 3, 17]
    assert total == 17
    assert torch.equal(indices, chunk_indices_host(torch.tensor(cu)))


def test_split_cuts_only_segments_longer_than_the_piece_and_maps_both_ways():
    cu = [0, 300, 300, 1000]  # 5 chunks, empty, 11 chunks; pieces of 4 chunks = 256 tokens
    bounds, c2r, r2c, last, first = qla.split_pieces(cu, 4)
    assert bounds == [0, 256, 300, 300, 556, 812, 1000]
    assert c2r == [0, 0, 1, 2, 2, 2]
    assert r2c == [0, 2, 3, 6]
    assert last == [False, True, True, False, False, True]
    assert first == [True, False, True, True, False, False]


def test_split_of_short_segments_is_one_piece_each():
    cu = [0, 64, 128, 200]
    bounds, c2r, r2c, last, first = qla.split_pieces(cu, 4)
    assert bounds == cu and c2r == [0, 1, 2] and r2c == [0, 1, 2, 3]
    assert all(last) and all(first)


def test_backend_name_is_checked():
    import pytest

    from kernels.gated_delta_rule import gdn_backend

    with pytest.raises(RuntimeError, match="gdn_backend=flash_qla cannot run"):
        gdn_backend("flash_qla")  # no CUDA here
