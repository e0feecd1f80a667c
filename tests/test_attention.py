"""Attention backend routing (models/common/attention.py) on the CPU.

cuDNN cannot run here, so the routing is checked with the device test forced open: a row the
caller marks as one segment goes to the dense (offset-free) path, whose numbers must equal the
packed path's; every other row keeps its offsets; a refusal by cuDNN warns once and falls back.
The kernels themselves are compared on the GPU by scripts/bench_attention.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from models.common import attention as attn
from models.common.packed_seq import PackedRowParams


def _qkv(tokens=48, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.fixture
def cudnn_open(monkeypatch):
    """The device and dtype test passes (as on an H200 in bf16); the dense call is recorded and run
    through SDPA."""
    calls = []
    monkeypatch.setattr(attn, "cudnn_dense_unavailable", lambda q: None)

    def fake_dense(q, k, v, causal, scale):
        calls.append(tuple(q.shape))
        rep = q.shape[2] // k.shape[2]
        return attn._sdpa_batched(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), causal, scale)

    monkeypatch.setattr(attn, "_cudnn_dense", fake_dense)
    return calls


@pytest.mark.parametrize("causal", [True, False])
def test_one_segment_row_takes_the_dense_path_with_the_same_numbers(cudnn_open, causal):
    q, k, v = _qkv()
    cu = torch.tensor([0, 48], dtype=torch.int32)
    out = attn.attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=48, one_segment=True)
    assert cudnn_open == [(1, 48, 4, 8)]  # [B=1, T, H, D]: the packed row as one batch row
    ref = attn.attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=48, backend="sdpa")
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):  # dk, dv summed back over the repeated heads
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rows_with_offsets_keep_them(cudnn_open):
    q, k, v = _qkv()
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    attn.attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=28)  # two samples: not one segment
    attn.attention(q, k, v, causal=True, cu_seqlens=torch.tensor([0, 48], dtype=torch.int32), max_seqlen=48,
                   one_segment=True, backend="sdpa")  # an explicit backend is obeyed
    assert cudnn_open == []
    attn.attention(*(t[None] for t in (q, k, v)), causal=True)  # an unpacked batch needs no offsets
    assert cudnn_open == [(1, 48, 4, 8)]


def test_packed_row_params_know_one_segment_rows():
    cu = torch.tensor([0, 48], dtype=torch.int32)
    row = PackedRowParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=48)
    assert row.one_segment(48)
    assert not PackedRowParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 20, 48]), max_seqlen_q=28).one_segment(48)
    # the CUDA graphs' static metadata: max_seqlen is the row length whatever the samples
    assert not PackedRowParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=48, static_shape=True).one_segment(48)


def test_a_cudnn_refusal_warns_once_and_falls_back(monkeypatch, caplog):
    # the real _cudnn_dense on CPU tensors: SDPA restricted to cuDNN finds no kernel and raises
    monkeypatch.setattr(attn, "cudnn_dense_unavailable",
                        lambda q: attn._cudnn_refused[0] if attn._cudnn_refused else None)
    monkeypatch.setattr(attn, "_cudnn_refused", [])
    monkeypatch.setattr(attn, "_cudnn_gqa_refused", [])
    q, k, v = _qkv()
    cu = torch.tensor([0, 48], dtype=torch.int32)
    with caplog.at_level(logging.WARNING, logger=attn.log.name):
        out = attn.attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=48, one_segment=True)
        again = attn.attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=48, one_segment=True)
    assert attn._cudnn_refused and "cuDNN refused" in attn._cudnn_refused[0]
    assert sum("cuDNN attention is off" in r.message for r in caplog.records) == 1
    ref = attn.attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=48, backend="sdpa")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(again, ref)


@pytest.mark.parametrize("gqa_accepted", [True, False])
def test_cudnn_gets_grouped_kv_heads_unrepeated_unless_it_refuses_them(monkeypatch, caplog, gqa_accepted):
    """The real _cudnn_dense with SDPA's cuDNN restriction lifted (no cuDNN on the CPU): grouped
    heads go in as they are; a refusal of them (once) makes it repeat them, same numbers."""
    import contextlib

    import torch.nn.attention as nn_attn

    monkeypatch.setattr(nn_attn, "sdpa_kernel", lambda backends: contextlib.nullcontext())
    monkeypatch.setattr(attn, "_cudnn_gqa_refused", [])
    seen = []
    real = attn._sdpa_batched

    def sdpa(q, k, v, causal, scale):
        seen.append(k.shape[2])
        if k.shape[2] != q.shape[2] and not gqa_accepted:
            raise RuntimeError("No available kernel (grouped query attention)")
        return real(q, k, v, causal, scale)

    monkeypatch.setattr(attn, "_sdpa_batched", sdpa)
    q, k, v = (t[None] for t in _qkv())  # 4 query heads, 2 k/v heads
    with caplog.at_level(logging.WARNING, logger=attn.log.name):
        out = attn._cudnn_dense(q, k, v, True, None)
        again = attn._cudnn_dense(q, k, v, True, None)
    ref = real(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), True, None)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(again, ref)
    if gqa_accepted:
        assert seen == [2, 2] and not attn._cudnn_gqa_refused
    else:  # refused once, then repeated without asking again
        assert seen == [2, 4, 4] and "grouped query" in attn._cudnn_gqa_refused[0]
        assert sum("refused grouped k/v heads" in r.message for r in caplog.records) == 1


def test_cudnn_is_not_used_off_cuda_or_in_fp32():
    q = torch.zeros(4, 2, 8)
    assert "bf16/fp16" in attn.cudnn_dense_unavailable(q)
    assert "CUDA" in attn.cudnn_dense_unavailable(q.bfloat16())


def test_graphs_keep_a_one_sample_set_only_where_auto_gives_those_rows_cudnn(monkeypatch):
    from models.performance import layer_graphs

    assert not layer_graphs.one_segment_set_wanted("auto", torch.device("cpu"))  # no cuDNN here
    monkeypatch.setattr(attn, "cudnn_device_unavailable", lambda device: None)  # as on an H200
    assert layer_graphs.one_segment_set_wanted("auto", torch.device("cuda"))
    assert not layer_graphs.one_segment_set_wanted("varlen", torch.device("cuda"))  # flash for every row


@pytest.fixture
def cudnn_thd_open(monkeypatch):
    """cuDNN's THD op loads (as on an H200 with nvidia-cudnn-frontend); it is recorded and run
    through the block-diagonal SDPA path."""
    calls = []
    monkeypatch.setattr(attn, "cudnn_packed_unavailable", lambda q: None)

    def fake_op(q, k, v, scale, *, is_causal, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, return_lse):
        calls.append({"bound": max_seqlen_q, "lse": return_lse, "contiguous": all(t.is_contiguous() for t in (q, k, v))})
        rep = q.shape[1] // k.shape[1]
        out = attn._sdpa_packed(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu_seqlens_q, is_causal, scale)
        return out, None

    monkeypatch.setattr(attn, "_cudnn_frontend", lambda: (fake_op, None))
    return calls


def test_auto_takes_cudnn_thd_for_static_non_causal_rows_only(cudnn_thd_open):
    q, k, v = _qkv(hkv=4)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    out = attn.attention(q, k, v, causal=False, cu_seqlens=cu, max_seqlen=48, static_shape=True)
    assert cudnn_thd_open == [{"bound": 128, "lse": True, "contiguous": True}]
    ref = attn.attention(q, k, v, causal=False, cu_seqlens=cu, max_seqlen=48, backend="sdpa")
    torch.testing.assert_close(out, ref)
    # eager rows (a plan per new shape would be built again and again) and causal rows keep flash/SDPA
    attn.attention(q, k, v, causal=False, cu_seqlens=cu, max_seqlen=28)
    attn.attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=48, static_shape=True)
    assert len(cudnn_thd_open) == 1
    with torch.no_grad():  # no backward coming: the forward keeps no softmax statistics
        attn.attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=48, backend="cudnn")
    assert cudnn_thd_open[-1]["lse"] is False


def test_strided_qkv_reach_cudnn_thd_as_contiguous_copies(cudnn_thd_open):
    """The vision blocks' q, k, v are slices of one [T, 3, H, D] tensor; cuDNN's backward faulted on
    them, so they go in contiguous, and gradients still reach the projection."""
    qkv = torch.randn(48, 3, 4, 8, requires_grad=True)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 30, 48], dtype=torch.int32)
    out = attn.attention(q, k, v, causal=False, cu_seqlens=cu, max_seqlen=30, static_shape=True)
    assert cudnn_thd_open[0]["contiguous"]
    out.sum().backward()
    ref_in = qkv.detach().clone().requires_grad_()
    attn.attention(*ref_in.unbind(1), causal=False, cu_seqlens=cu, max_seqlen=30, backend="sdpa").sum().backward()
    torch.testing.assert_close(qkv.grad, ref_in.grad)


def test_a_cudnn_thd_refusal_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(attn, "cudnn_packed_unavailable",
                        lambda q: attn._cudnn_packed_refused[0] if attn._cudnn_packed_refused else None)
    monkeypatch.setattr(attn, "_cudnn_packed_refused", [])
    seen = []

    def refusing_op(*a, **kw):
        seen.append(1)
        raise RuntimeError("cudnnGraphNotSupportedError: no engine for this configuration")

    monkeypatch.setattr(attn, "_cudnn_frontend", lambda: (refusing_op, None))
    q, k, v = _qkv(hkv=4)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    with caplog.at_level(logging.WARNING, logger=attn.log.name):
        out = attn.attention(q, k, v, causal=False, cu_seqlens=cu, max_seqlen=28, static_shape=True)
        again = attn.attention(q, k, v, causal=False, cu_seqlens=cu, max_seqlen=28, static_shape=True)
    assert seen == [1]  # asked once, then off for the run
    assert sum("cuDNN packed attention is off" in r.message for r in caplog.records) == 1
    ref = attn.attention(q, k, v, causal=False, cu_seqlens=cu, max_seqlen=28, backend="sdpa")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(again, ref)


def test_forcing_cudnn_where_it_cannot_run_says_why():
    q, k, v = _qkv(hkv=4)
    with pytest.raises(RuntimeError, match="attention backend 'cudnn' cannot run: needs bf16/fp16"):
        attn.attention(q, k, v, causal=True, cu_seqlens=torch.tensor([0, 48], dtype=torch.int32), max_seqlen=48,
                       backend="cudnn")


def test_seqlen_bounds_cover_the_row_and_stay_few():
    from models.qwen35_vl.vision_graphs import bucket_sizes

    bounds = {attn.seqlen_bound(n) for n in range(1, 32769)}
    assert all(attn.seqlen_bound(n) >= n for n in range(1, 32769))
    assert len(bounds) <= 8 + 8 * 5  # multiples of 128 to 1024, then eight per doubling to 32K
    # a vision graph bucket's row count (its max_seqlen) is a bound itself: no rows are added
    assert all(attn.seqlen_bound(rows) == rows for rows in bucket_sizes(24576, 1024))
