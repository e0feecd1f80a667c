"""train.deterministic: torch's deterministic kernels on, so megatron-core picks its ordered paths."""

from __future__ import annotations

import os

import torch

from test_training import _train


def test_switch_turns_torch_deterministic_kernels_on_and_off():
    from multimodal.platform import use_deterministic_algorithms

    try:
        use_deterministic_algorithms(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # ops without one warn, not stop
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"]
    finally:
        use_deterministic_algorithms(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_moe_combine_takes_the_ordered_path_and_agrees_with_scatter_add():
    """megatron's unpermute sums each token's top-k expert outputs with scatter_add (float atomics
    on a GPU: the order, so the bf16 result, varies) unless deterministic kernels are on, then with
    index_add; both give the same sum here (CPU, fp32)."""
    from megatron.core.transformer.moe import moe_utils

    from multimodal.platform import use_deterministic_algorithms

    g = torch.Generator().manual_seed(0)
    tokens, hidden, topk, experts = 6, 4, 3, 5
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        routing[t, torch.randperm(experts, generator=g)[:topk]] = True
    x = torch.randn(tokens, hidden, generator=g)
    permuted, _, sorted_indices, _, _ = moe_utils.permute(x, routing, num_out_tokens=tokens * topk)
    calls = []
    real_index_add = torch.Tensor.index_add_

    def spy(self, *a, **k):
        calls.append(1)
        return real_index_add(self, *a, **k)

    outs = {}
    for det in (False, True):
        use_deterministic_algorithms(det)
        try:
            torch.Tensor.index_add_ = spy
            outs[det] = moe_utils.unpermute(permuted, sorted_indices, x.shape, routing_map=routing)
        finally:
            torch.Tensor.index_add_ = real_index_add
            use_deterministic_algorithms(False)
    assert calls == [1]  # only the deterministic run used index_add
    torch.testing.assert_close(outs[True], outs[False])
    torch.testing.assert_close(outs[True], x * topk)  # every token came back topk times


def test_moe_proxy_trains_in_deterministic_mode(tmp_path):
    rows = _train(tmp_path, "train.deterministic=true", "train.iters=2", "train.seq_length=256",
                  "checkpoint.dir=null", config="configs/qwen35_vl_proxy_moe.yaml")
    assert sorted(rows) == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows.values())
