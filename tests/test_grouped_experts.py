"""Grouped-GEMM experts (models/common/grouped_experts.py) against megatron-core's SequentialMLP,
the grouped GEMM and the weighted SwiGLU against their references, the moe_act recompute, and
checkpoints written in SequentialMLP's per-expert layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.proxy_fixtures import forward, packed_rows, proxy_model

from fused_kernels import fused_swiglu as fs
from fused_kernels.grouped_gemm import grouped_mm, grouped_mm_reference

ROOT = Path(__file__).resolve().parents[1]
MOE = "configs/qwen35_vl_proxy_moe.yaml"


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _row_group(counts):
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


# ---------------------------------------------------------------------------- grouped GEMM


@pytest.mark.parametrize("counts", [[5, 0, 11, 1], [0, 0, 17, 0], [3, 3, 3, 3]])
def test_grouped_mm_reference_is_a_per_row_product(counts):
    torch.manual_seed(0)
    n, k, m = sum(counts), 16, 24
    a, b = torch.randn(n, k, dtype=torch.float64), torch.randn(len(counts), k, m, dtype=torch.float64)
    out = grouped_mm_reference(a, b, _offs(counts))
    expected = torch.einsum("nk,nkm->nm", a, b[_row_group(counts)])  # each row with its group's matrix
    torch.testing.assert_close(out, expected)
    # the weight-gradient form: group g sums over its own rows only, an empty group is zero
    c = torch.randn(n, m, dtype=torch.float64)
    wgrad = grouped_mm_reference(a.T, c, _offs(counts))
    onehot = torch.nn.functional.one_hot(_row_group(counts), len(counts)).to(a.dtype)  # [N, G]
    torch.testing.assert_close(wgrad, torch.einsum("ng,nk,nm->gkm", onehot, a, c))
    assert all(wgrad[g].abs().sum() == 0 for g, cnt in enumerate(counts) if cnt == 0)


def test_torch_grouped_mm_agrees_with_the_reference_where_it_runs_on_cpu():
    """torch's own CPU kernel (present in recent torch builds) against ours: the same operand
    layouts the experts pass (transposed weights and a transposed activation)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
    torch.manual_seed(0)
    counts = [8, 0, 16, 8]
    x, w = torch.randn(32, 16), torch.randn(4, 24, 16)  # w like linear_fc1: [E, out, in]
    offs = _offs(counts)
    torch.testing.assert_close(torch._grouped_mm(x, w.mT, offs=offs), grouped_mm_reference(x, w.mT, offs))
    g = torch.randn(32, 24)
    ours = grouped_mm_reference(g.mT, x, offs)
    torch.testing.assert_close(torch._grouped_mm(g.mT, x, offs=offs).masked_fill(
        torch.tensor([c == 0 for c in counts])[:, None, None], 0), ours)


def test_grouped_mm_falls_back_once_on_cpu(caplog):
    a, b = torch.randn(6, 8), torch.randn(2, 8, 4)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            out = grouped_mm(a, b, _offs([2, 4]))
    torch.testing.assert_close(out, grouped_mm_reference(a, b, _offs([2, 4])))
    assert sum("torch._grouped_mm not used" in r.message for r in caplog.records) <= 1  # once per process


# ---------------------------------------------------------------------------- weighted SwiGLU

_INTERP_CHECK = """
import json, torch
from fused_kernels import fused_swiglu as fs
torch.manual_seed(0)
out = []
for n, f in [(37, 48), (5, 1100), (0, 16)]:
    y = torch.randn(n, 2 * f); p = torch.rand(n); g = torch.randn(n, f)
    assert fs.available(y) is None
    fwd = (fs.weighted_swiglu_forward(y, p) - fs.weighted_swiglu_reference(y, p)).abs().max().item() if n else 0.0
    dy, dp = fs.weighted_swiglu_backward(g, y, p)
    rdy, rdp = fs.weighted_swiglu_back_reference(g, y, p)
    out.append([n, f, fwd, (dy - rdy).abs().max().item() if n else 0.0, (dp - rdp).abs().max().item() if n else 0.0])
print(json.dumps(out))
"""


def _under_interpreter(script: str):
    """Run ``script`` with Triton's CPU interpreter in a fresh process; its last line, as JSON."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_weighted_swiglu_kernel_matches_reference_under_interpreter():
    rows = _under_interpreter(_INTERP_CHECK)
    assert len(rows) == 3
    for n, f, *errs in rows:
        assert max(errs) < 1e-5, (n, f, errs)


def test_weighted_swiglu_reference_gradients_are_autograd_gradients():
    torch.manual_seed(0)
    y = torch.randn(9, 20, dtype=torch.float64, requires_grad=True)
    p = torch.rand(9, dtype=torch.float64, requires_grad=True)
    g = torch.randn(9, 10, dtype=torch.float64)
    a, b = y.chunk(2, -1)
    (torch.nn.functional.silu(a) * b * p[:, None]).backward(g)
    dy, dp = fs.weighted_swiglu_back_reference(g, y.detach(), p.detach())
    torch.testing.assert_close(dy, y.grad)
    torch.testing.assert_close(dp, p.grad)


# ---------------------------------------------------------------------------- experts module


def _experts_pair(num_experts=6):
    """(GroupedExperts, SequentialMLP) of the MoE proxy's shapes holding the same weights."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from models.common.grouped_experts import GroupedExperts
    from models.qwen35_vl.model import transformer_config
    from multimodal.config import load_config

    cfg = load_config(MOE, [f"model.num_experts={num_experts}"])
    tcfg = transformer_config(cfg.model, cfg.parallel, torch.float32)
    pgs = get_default_pg_collection()
    torch.manual_seed(0)
    grouped = GroupedExperts(num_experts, tcfg, pg_collection=pgs)
    backend = LocalSpecProvider()
    seq = SequentialMLP(num_experts, tcfg, MLPSubmodules(linear_fc1=backend.column_parallel_linear(),
                                                         linear_fc2=backend.row_parallel_linear()),
                        pg_collection=pgs)
    with torch.no_grad():
        for e, expert in enumerate(seq.local_experts):
            expert.linear_fc1.weight.copy_(grouped.linear_fc1.weight[e])
            expert.linear_fc2.weight.copy_(grouped.linear_fc2.weight[e])
    return grouped, seq


def _run(module, x, counts, probs):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = module(x, torch.tensor(counts), probs)
    assert bias is None
    g = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), x.grad, probs.grad, grads


@pytest.mark.parametrize("counts", [[0, 3, 0, 40, 1, 4], [8, 8, 8, 8, 8, 8], [0, 0, 0, 0, 0, 21]])
def test_grouped_experts_equal_sequential_mlp(mcore, counts):
    """Outputs and every gradient (input, router probabilities, each expert's two weights), with
    empty experts and one expert taking most tokens."""
    grouped, seq = _experts_pair()
    torch.manual_seed(1)
    x = torch.randn(sum(counts), grouped.config.hidden_size)
    probs = torch.rand(sum(counts))
    out_g, dx_g, dp_g, grads_g = _run(grouped, x, counts, probs)
    out_s, dx_s, dp_s, grads_s = _run(seq, x, counts, probs)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_g, out_s, **tol)
    torch.testing.assert_close(dx_g, dx_s, **tol)
    torch.testing.assert_close(dp_g, dp_s, **tol)
    for e in range(len(counts)):
        for fc in ("linear_fc1", "linear_fc2"):
            ours = grads_g[f"{fc}.weight"][e]
            theirs = grads_s.get(f"local_experts.{e}.{fc}.weight")
            if counts[e] == 0:  # SequentialMLP gives an unused expert no gradient at all; we give zeros
                assert theirs is None or not theirs.any()
                assert not ours.any(), f"expert {e} saw no token but got a gradient"
            else:
                torch.testing.assert_close(ours, theirs, **tol, msg=f"{fc} of expert {e}")


def test_expert_weight_gradients_go_into_main_grad(mcore):
    """Under DDP (a ``main_grad`` and the ``grad_added_to_main_grad`` flag), the backward adds the
    expert weight gradients into main_grad itself, bit for bit what DDP's hook would add, and flags
    them so the hook does not add them again; frozen experts compute no weight gradient."""
    counts = [0, 3, 0, 40, 1, 4]
    grouped, _ = _experts_pair()
    torch.manual_seed(1)
    x, probs = torch.randn(sum(counts), grouped.config.hidden_size), torch.rand(sum(counts))
    out, dx, dp, want = _run(grouped, x, counts, probs)
    weights = {"linear_fc1.weight": grouped.linear_fc1.weight, "linear_fc2.weight": grouped.linear_fc2.weight}
    for w in weights.values():
        w.main_grad = torch.full_like(w, 0.5)  # a previous micro-batch's sum is added to, not replaced
        w.grad_added_to_main_grad = False
    _run(grouped, x, counts, probs)
    for name, w in weights.items():
        assert w.grad_added_to_main_grad, name
        assert torch.equal(w.main_grad, torch.full_like(w, 0.5) + want[name]), name
        del w.main_grad, w.grad_added_to_main_grad
    grouped.zero_grad(set_to_none=True)  # the placeholders autograd handed on (DDP's hook drops them)
    for w in weights.values():
        w.requires_grad_(False)
    x2 = x.clone().requires_grad_()
    y, _ = grouped(x2, torch.tensor(counts), probs)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    assert torch.equal(x2.grad, dx) and all(w.grad is None for w in weights.values())


_ACCUMULATE_CHECK = """
import json, torch
from fused_kernels import main_grad_accumulate as m
out = []
for n in (1, 4095, 4097, 3 * 4096 + 5):
    torch.manual_seed(n)
    main = torch.randn(n) * 1e3
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    ref = main.clone()
    m.accumulate_reference(ref, grad)
    assert m.available(main, grad) is None
    m.accumulate_(main, grad)
    out.append([n, bool(torch.equal(main, ref))])
print(json.dumps(out))
"""


def test_main_grad_accumulate_kernel_is_bit_exact_under_interpreter():
    assert _under_interpreter(_ACCUMULATE_CHECK) == [[1, True], [4095, True], [4097, True], [12293, True]]


def test_main_grad_accumulate_refuses_what_it_cannot_add():
    from fused_kernels import main_grad_accumulate as m

    main = torch.zeros(4, 3)
    assert "bfloat16 is not fp32" in m.available(main.bfloat16(), torch.zeros(4, 3, dtype=torch.bfloat16))
    assert "shapes differ" in m.available(main, torch.zeros(3, 4, dtype=torch.bfloat16))
    main.add_(1)
    m.accumulate_(main, torch.ones(4, 3, dtype=torch.bfloat16))  # the CPU path: torch's add_
    assert torch.equal(main, torch.full((4, 3), 2.0))


def test_moe_act_recompute_is_bit_exact(mcore):
    grouped, _ = _experts_pair()
    counts = [0, 3, 0, 40, 1, 4]
    torch.manual_seed(1)
    x, probs = torch.randn(sum(counts), grouped.config.hidden_size), torch.rand(sum(counts))
    plain = _run(grouped, x, counts, probs)
    grouped.recompute_act = True
    again = _run(grouped, x, counts, probs)
    for a, b in zip(plain[:3], again[:3]):
        assert torch.equal(a, b)
    assert all(torch.equal(plain[3][n], again[3][n]) for n in plain[3])


# ---------------------------------------------------------------------------- dispatch


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    total = (forward(model, batch) * batch["loss_mask"]).sum()
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grouped_dispatcher_equals_megatrons_and_is_deterministic(mcore):
    """The sync-free dispatch (gathers through the inverse permutation, fp32 sums) against
    megatron's own all-to-all dispatcher (argsort + index_add / scatter_add) on the MoE proxy:
    the loss and every gradient, router and experts included; and the same bits run to run."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from models.common.moe_dispatch import GroupedDispatcher

    cfg, model = proxy_model(config=MOE)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert layers and all(type(m.token_dispatcher) is GroupedDispatcher for m in layers)
    batch = packed_rows(cfg)[0]
    ours = _loss_and_grads(model, batch)
    again = _loss_and_grads(model, batch)
    assert torch.equal(ours[0], again[0]) and all(torch.equal(ours[1][n], again[1][n]) for n in ours[1])
    for m in layers:
        m.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
    theirs = _loss_and_grads(model, batch)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    assert ours[1].keys() == theirs[1].keys() and any("router" in n for n in ours[1])
    for n in ours[1]:
        torch.testing.assert_close(ours[1][n], theirs[1][n], rtol=1e-5, atol=1e-7, msg=n)


# ---------------------------------------------------------------------------- checkpoints


def _sequential_spec(monkeypatch):
    """Build the MoE proxy the way it was built before the grouped experts: SequentialMLP."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend

    from models.qwen35_vl import specs

    monkeypatch.setattr(specs, "_mlp_spec", lambda n: get_mlp_module_spec_for_backend(
        LocalSpecProvider(), num_experts=n, moe_grouped_gemm=False))


def test_checkpoint_in_the_sequential_layout_loads_and_round_trips(mcore, tmp_path, monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from models.common.grouped_experts import GroupedExperts
    from multimodal import checkpointing

    with monkeypatch.context() as m:
        _sequential_spec(m)
        _, old = proxy_model(["model.num_experts=4"], config=MOE)
    assert any(isinstance(mod, SequentialMLP) for mod in old.modules())
    with torch.no_grad():  # distinct values per expert, so a misplaced expert cannot pass
        for n, p in old.named_parameters():
            if "local_experts" in n:
                p.copy_(torch.randn_like(p))
    checkpointing.save_weights(tmp_path / "old", old)

    torch.manual_seed(123)
    _, new = proxy_model(["model.num_experts=4", "model.init_method_std=0.5"], config=MOE)
    assert any(isinstance(mod, GroupedExperts) for mod in new.modules())
    checkpointing.load_weights(checkpointing.resolve("latest", str(tmp_path / "old")), new)
    old_sd, new_sd = old.state_dict(), new.state_dict()

    def expected(name):  # the old model's tensor for one of the new model's names
        if ".experts.linear_fc" in name:
            layer, fc = name.rsplit(".experts.", 1)[0], name.split(".experts.")[1].split(".")[0]
            return torch.stack([old_sd[f"{layer}.experts.local_experts.{e}.{fc}.weight"] for e in range(4)])
        return old_sd[name]

    for name, tensor in new_sd.items():
        if not name.endswith("_extra_state"):
            assert torch.equal(tensor, expected(name)), name
    # and back: the grouped model writes the same tensors, under the same keys and global shapes,
    # as SequentialMLP did (which adds only empty _extra_state objects), and reloads
    from megatron.core import dist_checkpointing

    checkpointing.save_weights(tmp_path / "new", new)
    meta_old = dist_checkpointing.load_tensors_metadata(str(tmp_path / "old" / "iter_0000000"))
    meta_new = dist_checkpointing.load_tensors_metadata(str(tmp_path / "new" / "iter_0000000"))
    assert set(meta_new) == {k for k in meta_old if not k.endswith("_extra_state")}
    assert any(".experts.experts.linear_fc1" in k for k in meta_new)
    assert all(meta_new[k].global_shape == meta_old[k].global_shape for k in meta_new)
    _, again = proxy_model(["model.num_experts=4", "model.init_method_std=0.5"], config=MOE)
    checkpointing.load_weights(checkpointing.resolve("latest", str(tmp_path / "new")), again)
    assert all(torch.equal(t, new_sd[n]) for n, t in again.state_dict().items() if not n.endswith("_extra_state"))
    # a plain (torch) state dict in SequentialMLP's names loads too
    _, plain = proxy_model(["model.num_experts=4", "model.init_method_std=0.5"], config=MOE)
    plain.load_state_dict(old_sd)
    assert all(torch.equal(t, expected(n)) for n, t in plain.state_dict().items() if not n.endswith("_extra_state"))


# ---------------------------------------------------------------------------- memory after training

_FREED_CHECK = """
import gc, sys, torch
sys.path.insert(0, {root!r})
from multimodal.config import load_config
from multimodal.platform import init_distributed
from multimodal.training import train
cfg = load_config("configs/qwen35_vl_proxy_moe.yaml", ["train.iters=2", "checkpoint.dir=null",
                  "logging.dir={log}", "logging.progress_bar=false", "logging.tensorboard=false",
                  "checkpoint.save_at_end=false"])
init_distributed()
train(cfg)
gc.collect()
print("LIVE", sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects()))
"""


def test_a_finished_moe_run_frees_its_model(tmp_path):
    """The dispatcher used to keep the router probabilities, whose autograd graph holds DDP's
    hooks and through them the model: nothing of a finished run could be freed."""
    script = _FREED_CHECK.format(root=str(ROOT), log=str(tmp_path / "log"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    live = [line for line in proc.stdout.splitlines() if line.startswith("LIVE")]
    assert live == ["LIVE 0"], proc.stdout[-2000:]
