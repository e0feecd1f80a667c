"""Fused linear cross-entropy against full logits + F.cross_entropy: loss, dh, dW.

Also runnable under torchrun (2 gloo processes) for the vocab-parallel check:
    torchrun --nproc-per-node 2 tests/test_fused_linear_ce.py OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

from fused_kernels.fused_linear_ce import fused_linear_cross_entropy, linear_cross_entropy_reference

TOL = {torch.float32: dict(loss=1e-5, grad=1e-5), torch.bfloat16: dict(loss=2e-2, grad=2e-2)}


def _inputs(n, h, v, dtype, seed=0, ignore=()):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h**-0.5 * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    for i in ignore:
        labels[i] = -100
    upstream = torch.rand(n, generator=g)  # per-token weights, like a loss mask / token count
    return hidden, weight, labels, upstream


def _grads(fn, hidden, weight, labels, upstream):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels)
    (loss * upstream).sum().backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, h, v, token_chunk, vocab_chunk", [
    (37, 16, 53, 5, 7),         # neither chunk divides its dimension
    (64, 32, 256, None, None),  # default: one chunk each
    (100, 24, 1000, 33, 129),
    (1, 8, 10, 4, 3),           # one token; chunks larger than it
])
def test_matches_full_logits_reference(dtype, n, h, v, token_chunk, vocab_chunk):
    hidden, weight, labels, up = _inputs(n, h, v, dtype, ignore=(0,) if n > 1 else ())
    fused = _grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, token_chunk=token_chunk,
                                                              vocab_chunk=vocab_chunk), hidden, weight, labels, up)
    ref = _grads(linear_cross_entropy_reference, hidden, weight, labels, up)
    assert fused[0].dtype == torch.float32 and fused[0].shape == (n,)
    tol = TOL[dtype]
    torch.testing.assert_close(fused[0], ref[0], rtol=tol["loss"], atol=tol["loss"])
    assert fused[1].dtype == dtype and fused[2].dtype == dtype
    assert _rel(fused[1], ref[1]) < tol["grad"], _rel(fused[1], ref[1])
    assert _rel(fused[2], ref[2]) < tol["grad"], _rel(fused[2], ref[2])
    if n > 1:  # ignored token: zero loss, zero gradient on its hidden row
        assert fused[0][0] == 0 and fused[1][0].abs().max() == 0


def test_chunking_does_not_change_fp32_results():
    """Different chunkings agree to fp32 rounding (they only regroup sums)."""
    hidden, weight, labels, up = _inputs(50, 16, 300, torch.float32, seed=3)
    a = _grads(lambda x, w, y: fused_linear_cross_entropy(x, w, y, token_chunk=7, vocab_chunk=41),
               hidden, weight, labels, up)
    b = _grads(lambda x, w, y: fused_linear_cross_entropy(x, w, y), hidden, weight, labels, up)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_frozen_weight():
    hidden, weight, labels, up = _inputs(24, 8, 40, torch.float32, seed=5)
    weight.requires_grad_(False)
    loss = fused_linear_cross_entropy(hidden.view(4, 6, 8), weight, labels.view(4, 6), token_chunk=5)
    assert loss.shape == (4, 6)
    (loss.reshape(-1) * up).sum().backward()
    ref_h = hidden.detach().clone().requires_grad_()
    (linear_cross_entropy_reference(ref_h, weight, labels) * up).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="disagree"):
        fused_linear_cross_entropy(hidden, weight, labels[:3])


def test_large_logits_are_stable():
    """Logits in the hundreds: logsumexp must not overflow in fp32."""
    hidden, weight, labels, up = _inputs(16, 8, 64, torch.float32, seed=7)
    with torch.no_grad():
        weight.mul_(200.0)
    fused = _grads(lambda x, w, y: fused_linear_cross_entropy(x, w, y, token_chunk=3, vocab_chunk=10),
                   hidden, weight, labels, up)
    ref = _grads(linear_cross_entropy_reference, hidden, weight, labels, up)
    assert all(torch.isfinite(t).all() for t in fused)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-3)
    assert _rel(fused[2], ref[2]) < 1e-4  # exp(x - lse) at |x| ~ 1e3: one ulp of lse is ~6e-5


# ------------------------------------------------------------------ the sparse LM head


def _sparse_inputs(seed, s=12, b=2, h=16, v=50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.6).float() * torch.rand(b, s, generator=g)  # weighted mask
    return hidden, weight, labels, mask


def test_sparse_lm_head_equals_the_dense_loss_at_the_loss_tokens():
    """Losses at the loss tokens, zero elsewhere; hidden and weight gradients of the masked loss
    equal the dense run's. An empty index (a micro-batch without loss tokens) gives zeros."""
    from fused_kernels.fused_linear_ce import vocab_parallel_linear_cross_entropy as vplce
    from multimodal.forward_step import loss_token_index

    hidden, weight, labels, mask = _sparse_inputs(3)
    index = loss_token_index(mask)
    assert 0 < len(index) < mask.numel()
    runs = []
    for idx in (None, index):
        hidden.grad = weight.grad = None
        loss = vplce(hidden, weight, labels, token_index=idx)
        (loss * mask).sum().backward()
        runs.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    (dense, dh, dw), (sparse, sh, sw) = runs
    assert torch.equal(sparse[mask == 0], torch.zeros_like(sparse[mask == 0]))
    torch.testing.assert_close(sparse[mask != 0], dense[mask != 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sh, dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sw, dw, rtol=1e-5, atol=1e-6)
    hidden.grad = weight.grad = None
    empty = vplce(hidden, weight, labels, token_index=torch.zeros(0, dtype=torch.long))
    empty.sum().backward()
    assert not empty.any() and not hidden.grad.any() and not weight.grad.any()


def test_sparse_lm_head_flops_count_the_loss_tokens_only():
    from multimodal.config import load_config
    from multimodal.flops import training_flops

    m = load_config("configs/qwen35_vl_2b.yaml").model
    lengths, grids = [3000, 5000], [(1, 28, 28)]
    dense = training_flops(m, lengths, grids)
    assert training_flops(m, lengths, grids, lm_head_tokens=8000) == dense
    saved = dense - training_flops(m, lengths, grids, lm_head_tokens=100)
    assert saved == pytest.approx(3 * 2 * m.hidden_size * m.vocab_size * 7900)


# ------------------------------------------------------------------ the whole model


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_proxy_model_loss_and_grads_equal_with_fused_ce_on_and_off(mcore, tied):
    """Per-token losses and every parameter gradient of the proxy model, fused CE (dense, and sparse:
    only at the loss tokens) vs megatron's output layer + vocab_parallel_cross_entropy (same
    weights, same batch, fp32)."""
    from data.collate import pack_thd
    from data.mock import MockDataset
    from models import get_model_builder
    from multimodal.config import load_config
    from multimodal.forward_step import loss_token_index, packed_seq_params
    from core.seeding import seed_everything

    cfg = load_config("configs/qwen35_vl_proxy.yaml", [f"model.tie_word_embeddings={str(tied).lower()}"])
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    assert model.language_model.fused_linear_ce  # the default
    m = cfg.model
    ds = MockDataset(m, cfg.data, 256)
    batch = pack_thd([ds[0], ds[1]], 384, pad_id=m.pad_token_id, image_token_id=m.image_token_id,
                     merge=m.vision.spatial_merge_size)

    def run(fused: bool, sparse: bool = False):
        model.language_model.fused_linear_ce = fused
        model.zero_grad(set_to_none=True)
        params = packed_seq_params(batch)
        if sparse:  # model.sparse_lm_head: what forward_step adds to packed batches
            params.loss_token_index = loss_token_index(batch["loss_mask"])
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                     pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                     packed_seq_params=params)
        (loss * batch["loss_mask"]).sum().backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_f, grads_f = run(True)
    loss_u, grads_u = run(False)
    loss_s, grads_s = run(True, sparse=True)
    assert loss_f.shape == loss_u.shape == loss_s.shape == batch["labels"].shape
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-5, atol=1e-5)
    kept = batch["loss_mask"] != 0
    assert 0 < int(kept.sum()) < int(batch["num_real_tokens"])  # SFT: most tokens carry no loss
    torch.testing.assert_close(loss_s[kept], loss_u[kept], rtol=1e-5, atol=1e-5)
    assert not loss_s[~kept].any()
    assert set(grads_f) == set(grads_u) == set(grads_s) and len(grads_f) > 10
    out_w = "language_model.embedding.word_embeddings.weight" if tied else "language_model.output_layer.weight"
    assert out_w in grads_f
    # relative to each gradient's norm, floored at 1e-3 of the largest (a ~1e-4-norm dt_bias
    # gradient would otherwise report pure fp32 rounding of the summation order)
    floor = 1e-3 * max(g.norm().item() for g in grads_u.values())
    for grads in (grads_f, grads_s):
        for name, g in grads_u.items():
            err = (grads[name] - g).norm().item() / max(g.norm().item(), floor)
            assert err < 1e-4, (name, err)


def test_forward_step_gives_the_model_the_loss_tokens_and_counts_them(mcore):
    """ForwardStep with sparse_lm_head: the same masked loss as without, and the host-side count
    of LM-head tokens that the FLOPs use."""
    from data.collate import pack_thd
    from data.mock import MockDataset
    from models import get_model_builder, get_model_family
    from multimodal.config import load_config
    from multimodal.forward_step import ForwardStep
    from core.seeding import seed_everything

    cfg = load_config("configs/qwen35_vl_proxy.yaml")
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    m = cfg.model
    ds = MockDataset(m, cfg.data, 256)
    batch = pack_thd([ds[0], ds[1], ds[2]], 384, pad_id=m.pad_token_id, image_token_id=m.image_token_id,
                     merge=m.vision.spatial_merge_size)
    results = {}
    for sparse in (False, True):
        step = ForwardStep(torch.device("cpu"), torch.float32, image_token_id=m.image_token_id, sparse_lm_head=sparse,
                           row_extras=get_model_family(m.name).packed_row_extras)
        out, loss_fn = step(iter([batch]), model)
        loss_sum, n, _ = loss_fn(out)
        results[sparse] = (loss_sum.item(), int(n), step.batches[0]["lm_head_tokens"])
    (dense_loss, dense_n, dense_count), (sparse_loss, sparse_n, sparse_count) = results[False], results[True]
    assert dense_count is None and sparse_count == int((batch["loss_mask"] != 0).sum()) == sparse_n == dense_n
    assert sparse_loss == pytest.approx(dense_loss, rel=1e-6)


# ------------------------------------------------------------------ TP=2 (gloo)


def _tp_main(out_dir: str) -> None:
    """Each rank holds half the vocabulary rows; compares with the full-vocabulary reference."""
    from megatron.core import parallel_state as ps

    from fused_kernels.fused_linear_ce import vocab_parallel_linear_cross_entropy
    from multimodal.forward_step import loss_token_index
    from multimodal.platform import init_distributed

    init_distributed()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    results = {}
    for sp, sparse in ((False, False), (True, False), (True, True)):
        s, b, h, v = 10, 2, 16, 90  # S divisible by TP for sequence parallel; V/TP = 45
        full_h, full_w, labels_sb, _ = _inputs(s * b, h, v, torch.float32, seed=11, ignore=(3,))
        full_h = full_h.detach().view(s, b, h)
        full_w = full_w.detach()
        labels_bs = labels_sb.view(s, b).t().contiguous()
        up = torch.rand(b, s, generator=torch.Generator().manual_seed(12))
        if sparse:  # the loss only at a third of the tokens (and computed only there)
            up = up * (torch.arange(b * s).view(b, s) % 3 == 0)

        ref_h = full_h.clone().requires_grad_()
        ref_w = full_w.clone().requires_grad_()
        ref_loss = linear_cross_entropy_reference(ref_h, ref_w, labels_bs.t()).t()
        (ref_loss * up).sum().backward()

        shard = v // 2
        my_w = full_w[rank * shard:(rank + 1) * shard].clone().requires_grad_()
        my_h = (full_h[rank * s // 2:(rank + 1) * s // 2] if sp else full_h).clone().requires_grad_()
        if sparse:
            ref_loss = ref_loss * (up != 0)  # the sparse head leaves the other tokens at 0
        index = loss_token_index(up) if sparse else None
        loss = vocab_parallel_linear_cross_entropy(my_h, my_w, labels_bs, tp_group=group, sequence_parallel=sp,
                                                   token_chunk=6, vocab_chunk=13, token_index=index)
        (loss * up).sum().backward()
        exp_h = ref_h.grad[rank * s // 2:(rank + 1) * s // 2] if sp else ref_h.grad
        results[f"sp={sp}" + (",sparse" if sparse else "")] = {
            "loss": (loss - ref_loss).abs().max().item(),
            "grad_h": (my_h.grad - exp_h).abs().max().item(),
            "grad_w": (my_w.grad - ref_w.grad[rank * shard:(rank + 1) * shard]).abs().max().item(),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    ps.destroy_model_parallel()


def test_vocab_parallel_tp2_matches_full_vocab(tmp_path):
    from test_hf import _env
    from test_training import _free_port

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
         str(Path(__file__)), str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(res) == {"sp=False", "sp=True", "sp=True,sparse"}
        for mode, diffs in res.items():
            for name, d in diffs.items():
                assert d < 1e-5, (rank, mode, name, d)


if __name__ == "__main__":
    _tp_main(sys.argv[1])


_INTERPRETER_CHECK = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from fused_kernels import fused_linear_ce as flce
from fused_kernels.triton_support import unavailable_reason

out = []
for dtype in (torch.float32, torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    n, h, v = 37, 16, 2500  # vocab spans several kernel blocks, the last one partial
    hidden0 = torch.randn(n, h, generator=g).to(dtype)
    weight0 = (torch.randn(v, h, generator=g) * 0.7).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[0, 5]] = -100
    up = torch.rand(n, generator=g)
    res = {}
    for name, use in (("triton", True), ("torch", False)):
        assert unavailable_reason(hidden0) is None  # the interpreter runs the kernels
        flce._use_triton = (lambda x: True) if use else (lambda x: False)
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        loss = flce.fused_linear_cross_entropy(hidden, weight, labels, token_chunk=16, vocab_chunk=900)
        (loss * up).sum().backward()
        res[name] = [loss.detach().float(), hidden.grad.float(), weight.grad.float()]
    rel = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(res["triton"], res["torch"])]
    out.append({"dtype": str(dtype), "rel": rel, "loss_ignored": res["triton"][0][[0, 5]].tolist()})
print(json.dumps(out))
'''


@pytest.mark.slow
def test_triton_ce_kernels_match_the_pytorch_path_under_interpreter(tmp_path):
    """fused_kernels/ce_triton.py (one-pass logsumexp/target and in-place softmax gradient) against the
    PyTorch ops it replaces, through the whole fused loss: loss, dh and dW, several token and
    vocabulary chunks, ignored labels, fp32 and bf16."""
    import os

    script = tmp_path / "check.py"
    script.write_text(_INTERPRETER_CHECK)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:
        tol = 1e-5 if r["dtype"] == "torch.float32" else 1e-2  # bf16: one rounding of the stored gradient
        assert max(r["rel"]) < tol, r
        assert r["loss_ignored"] == [0.0, 0.0], r
