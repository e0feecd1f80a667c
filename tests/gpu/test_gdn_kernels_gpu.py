"""The gated delta rule's GPU implementations against an fp32 PyTorch reference, and their speed.

    python tests/gpu/test_gdn_kernels_gpu.py [--json OUT] [--iters 20]

Implementations (each where it imports):
- ``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` (what ``model.gdn_save_states=false`` runs);
- ``fla_saved``: fused_kernels/fla_saved_states.py, fla's kernels with the chunk states kept from the
  forward (``model.gdn_save_states=true``); must equal ``fla`` bit for bit, since it runs the same
  kernels on the same values, minus the backward's recomputation;
- ``flash_qla`` / ``flash_qla_nocp``: the FlashQLA package (TileLang) called directly, with and
  without its automatic intra-card split of long sequences;
- ``qla_host_plan``: fused_kernels/flash_qla_gdr.py as the trainer runs it eagerly (``model.gdn_backend=
  flash_qla``): the split planned on the host;
- ``qla_graph_plan`` / ``qla_graph_plan_one_segment``: as the CUDA graphs run it: the padded static
  buffers of layer_graphs.StaticBatch (empty segments, padding rows in the chunk table), unsplit for
  rows of several samples, split for one-sample rows.

Inputs: bf16, the 2B recipe's 16 heads of 128, packed 8K rows of one and of several samples; the
reference is fused_kernels.gated_delta_rule.chunk_gated_delta_rule_ref on fp32 copies. For each: the
relative error (max |x - ref| / max |ref|) of the output and of every input gradient, the time of a
forward and of a forward+backward (CUDA events, median), and the memory the forward keeps for the
backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest
import torch


from fused_kernels import gated_delta_rule as gdr  # noqa: E402

ROWS = {"one_8192": [8192], "four_2048": [2048] * 4, "mixed": [3000, 1500, 2500, 1192]}
NAMES = ["o", "dq", "dk", "dv", "dg", "dbeta"]


def inputs(lens, heads=16, dk=128, dv=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = torch.nn.functional.normalize(rnd(1, T, heads, dk), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rnd(1, T, heads, dk), dim=-1).bfloat16()
    v = rnd(1, T, heads, dv).bfloat16()
    gate = torch.nn.functional.logsigmoid(rnd(1, T, heads) + 4.0)  # log decay, fp32 like the model's
    beta = torch.sigmoid(rnd(1, T, heads)).bfloat16()
    cot = rnd(1, T, heads, dv).bfloat16()
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    return [q, k, v, gate, beta], cot, cu


def implementations():
    impls = {}
    if gdr.fla_unusable_reason() is None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        # "fla" means fla's own kernels, as model.gdn_backend=fla runs them: with flash_qla
        # installed, fla would otherwise hand the call to FlashQLA by itself
        gdr._no_fla_flash_qla_dispatch()

        from fused_kernels.fla_saved_states import chunk_gated_delta_rule_saved_states

        impls["fla"] = lambda q, k, v, g, b, cu: fla_chunk(q, k, v, g=g, beta=b, cu_seqlens=cu)[0]
        impls["fla_saved"] = lambda q, k, v, g, b, cu: chunk_gated_delta_rule_saved_states(q, k, v, g, b, cu)
    else:
        print(f"fla: not run ({gdr.fla_unusable_reason()})")
    try:
        import flash_qla

        impls["flash_qla"] = lambda q, k, v, g, b, cu: flash_qla.chunk_gated_delta_rule(
            q, k, v, g, b, cu_seqlens=cu, auto_cp=True)[0]
        impls["flash_qla_nocp"] = lambda q, k, v, g, b, cu: flash_qla.chunk_gated_delta_rule(
            q, k, v, g, b, cu_seqlens=cu, auto_cp=False)[0]
    except Exception as e:  # not installed, or no SM90 toolchain
        print(f"flash_qla: not run ({type(e).__name__}: {e})")
        return impls
    from fused_kernels import flash_qla_gdr as qla

    plans = {}

    def host_plan(q, k, v, g, b, cu):  # what the trainer runs eagerly: the plan built on the host
        if cu not in plans:
            plans[cu] = qla.plan_from_host(cu.cpu(), cu.clone(), v.shape[2])
        return qla.chunk_gated_delta_rule(q, k, v, g, b, plans[cu])

    def static_plan(one_segment):  # what the CUDA graphs replay: padded buffers, fixed plan
        def run(q, k, v, g, b, cu):
            key = (cu, one_segment)
            if key not in plans:
                plans[key] = _static_plan(cu, q.shape[1], v.shape[2], one_segment)
            return qla.chunk_gated_delta_rule(q, k, v, g, b, plans[key].plan)
        return run

    impls["qla_host_plan"] = host_plan
    impls["qla_graph_plan"] = static_plan(False)
    impls["qla_graph_plan_one_segment"] = static_plan(True)
    return impls


MAX_SAMPLES = 8  # the graphs' padding: cu_seqlens up to this many samples, then empty segments


def _static_plan(cu, seq, heads, one_segment):
    """layer_graphs.StaticBatch's buffers for this row, filled as its load() fills them."""
    from fused_kernels import flash_qla_gdr as qla

    n_cu = MAX_SAMPLES + 2
    cu64 = torch.full((n_cu,), seq, dtype=torch.int64, device="cuda")
    chunks = torch.zeros((seq // gdr.FLA_CHUNK_SIZE + MAX_SAMPLES, 2), dtype=torch.int64, device="cuda")
    plan = qla.StaticPlan(cu64, chunks, seq, heads, one_segment)
    table = gdr.chunk_indices_host(cu.cpu()).cuda()
    cu64[: cu.numel()].copy_(cu)
    chunks[: table.shape[0]].copy_(table)
    chunks[table.shape[0]:, 0] = MAX_SAMPLES
    plan.load()
    return plan


def fwd_bwd(fn, tensors, cot, cu):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves, cu)
    grads = torch.autograd.grad(out, leaves, cot)
    return [out.detach(), *grads]


def median_ms(fn, iters):
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def saved_bytes(fn, tensors, cu):
    leaves = [t.detach().requires_grad_() for t in tensors]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(*leaves, cu)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return kept


def rel(x, ref):
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tol", type=float, default=2e-2, help="largest relative error accepted vs the fp32 reference")
    args = ap.parse_args(argv)
    impls = implementations()
    if not impls:
        print("nothing to check here (needs CUDA with fla or flash_qla)")
        return 1
    ok, report = True, {"device": torch.cuda.get_device_name(), "rows": {}}
    for row, lens in ROWS.items():
        tensors, cot, cu = inputs(lens)
        ref = fwd_bwd(lambda q, k, v, g, b, c: gdr.chunk_gated_delta_rule_ref(q, k, v, g, b, c),
                      [t.float() for t in tensors], cot.float(), cu)
        results, outs = {}, {}
        for name, fn in impls.items():
            if name == "qla_graph_plan_one_segment" and len(lens) != 1:
                continue  # that plan is for one-sample rows only
            try:
                outs[name] = fwd_bwd(fn, tensors, cot, cu)
            except Exception as e:
                print(f"{row} {name}: failed: {type(e).__name__}: {e}")
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                ok = False
                continue
            errs = {n: rel(x, r) for n, x, r in zip(NAMES, outs[name], ref)}
            leaves = [t.detach().requires_grad_() for t in tensors]
            fwd_ms = median_ms(lambda: fn(*[t.detach() for t in tensors], cu), args.iters)
            step_ms = median_ms(lambda: torch.autograd.grad(fn(*leaves, cu), leaves, cot), args.iters)
            results[name] = {"rel_err_vs_fp32_ref": errs, "fwd_ms": fwd_ms, "fwd_bwd_ms": step_ms,
                             "saved_for_backward_mib": saved_bytes(fn, tensors, cu) / 2**20}
            worst = max(errs.values())
            ok &= worst <= args.tol
            print(f"{row:10s} {name:15s} fwd {fwd_ms:7.3f} ms  fwd+bwd {step_ms:7.3f} ms  "
                  f"kept {results[name]['saved_for_backward_mib']:7.1f} MiB  worst rel err {worst:.2e} "
                  + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
            if name == "fla_saved" and "fla" in outs:  # printed at once: FlashQLA's first compile is slow
                same = [torch.equal(a, b) for a, b in zip(outs["fla"], outs["fla_saved"])]
                results["fla_saved_bitwise_equal_fla"] = dict(zip(NAMES, same))
                print(f"{row:10s} fla_saved == fla bit for bit: {dict(zip(NAMES, same))}")
                ok &= all(same)
        report["rows"][row] = {"lens": lens, **results}
    report["passed"] = ok
    print("PASSED" if ok else "FAILED")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


@pytest.mark.gpu
def test_gated_delta_rule_implementations_match_the_fp32_reference(run_check):
    """Every GDN implementation that imports here within tolerance of the fp32 reference; fla_saved equals fla bit for bit."""
    run_check(__file__)


if __name__ == "__main__":
    raise SystemExit(main())
