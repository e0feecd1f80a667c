"""On a GPU: the fast kernel paths give the same loss and gradients as the PyTorch references.

Builds a recipe's model on CUDA, runs the same packed mock batch with
  (a) GDN ops on flash-linear-attention vs the PyTorch reference, and
  (b) attention through varlen flash attention vs SDPA with a block-diagonal mask,
and prints one JSON line per comparison (max abs diff of per-token loss, max relative
grad-norm diff over parameters). Exit code 1 if a difference exceeds the tolerance.

    python tests/gpu/test_fast_paths_gpu.py --config configs/qwen35_vl_proxy.yaml [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch


from data.collate import pack_thd  # noqa: E402
from data.loader import build_dataset  # noqa: E402
from models import get_model_builder, get_model_family  # noqa: E402
from models.qwen35_vl.attention import CoreAttention  # noqa: E402
from models.qwen35_vl.gdn import Qwen35GatedDeltaNet  # noqa: E402
from multimodal.config import load_config  # noqa: E402
from multimodal.forward_step import packed_seq_params, to_device  # noqa: E402
from multimodal.platform import init_distributed  # noqa: E402
from core.seeding import seed_everything  # noqa: E402

RESULTS: list[dict] = []  # every comparison's line, for --json


def _emit(row: dict) -> None:
    RESULTS.append(row)
    print(json.dumps(row))


def run(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                 packed_seq_params=packed_seq_params(batch))
    (loss * batch["loss_mask"]).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def compare(name, a, b, tol_loss, tol_grad):
    """Loss diff, global relative grad diff, and per-parameter relative diffs for parameters whose
    gradient is not negligible (>= 1% of the largest): a parameter with a near-zero gradient
    (e.g. A_log of a layer far from the loss) has a relative diff that is pure rounding noise."""
    loss_diff = (a[0] - b[0]).abs().max().item()
    diff = torch.stack([(a[1][k] - b[1][k]).norm() for k in b[1]]).norm().item()
    total = torch.stack([b[1][k].norm() for k in b[1]]).norm().item()
    norms = {k: b[1][k].norm().item() for k in b[1]}
    floor = 0.01 * max(norms.values())
    rels = {k: ((a[1][k] - b[1][k]).norm().item() / norms[k]) for k in b[1] if norms[k] >= floor}
    rel = max(rels.values())
    ok = loss_diff <= tol_loss and rel <= tol_grad
    worst = sorted(rels, key=rels.get, reverse=True)[:3]
    _emit({"check": name, "max_abs_loss_diff": loss_diff, "global_rel_grad_diff": diff / total,
           "max_rel_grad_diff": rel, "ok": ok, "worst": {k: [rels[k], norms[k]] for k in worst}})
    return ok


def check_ops(dtype, device) -> bool:
    """fla's conv1d and chunk delta rule vs the PyTorch references on random packed inputs."""
    from fused_kernels import gated_delta_rule as gdr

    g = torch.Generator(device="cpu").manual_seed(0)
    lens = [100, 37, 300, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    T, H, K, V, D = sum(lens), 4, 128, 128, 96

    def leaf(*shape, scale=1.0, fn=None):
        x = torch.randn(*shape, generator=g) * scale
        x = fn(x) if fn else x
        return x.to(device, dtype).requires_grad_()

    ok = True
    x, w = leaf(1, T, D), leaf(D, 4, scale=0.5)
    outs = []
    for backend in ("torch", "fla"):
        x.grad = w.grad = None
        y = gdr.causal_conv1d_silu(x, w, cu, backend)
        y.float().square().sum().backward()
        outs.append((y.detach().float(), [x.grad.float().clone(), w.grad.float().clone()]))
    ok &= _report("conv1d fla vs torch", outs, ["x", "w"])

    q, k = leaf(1, T, H, K), leaf(1, T, H, K)
    v = leaf(1, T, H, V)
    gate = leaf(1, T, H, fn=lambda t: -torch.rand_like(t) * 0.5)
    beta = leaf(1, T, H, fn=torch.sigmoid)
    weight = torch.randn(1, T, H, V, generator=g).to(device)
    outs = []
    for backend in ("torch", "fla"):
        for t in (q, k, v, gate, beta):
            t.grad = None
        o = gdr.chunk_gated_delta_rule(gdr.l2norm(q), gdr.l2norm(k), v, gate, beta, cu, backend)
        (o.float() * weight).sum().backward()
        outs.append((o.detach().float(), [t.grad.float().clone() for t in (q, k, v, gate, beta)]))
    ok &= _report("chunk_gated_delta_rule fla vs torch", outs, ["q", "k", "v", "g", "beta"])
    return ok


def _report(name, outs, names) -> bool:
    (ref_y, ref_g), (y, grads) = outs
    out_rel = ((y - ref_y).norm() / ref_y.norm()).item()
    rels = {n: ((a - b).norm() / (b.norm() + 1e-12)).item() for n, a, b in zip(names, grads, ref_g)}
    ok = out_rel < 2e-2 and max(rels.values()) < 5e-2
    _emit({"check": name, "out_rel_diff": out_rel, "grad_rel_diff": rels, "ok": ok})
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen35_vl_proxy.yaml")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--ops-only", action="store_true", help="only the op-level comparisons")
    ap.add_argument("--json", help="write every comparison as a JSON list here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rt = init_distributed()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    seed_everything(0)
    cfg = load_config(args.config, args.overrides)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ok = check_ops(dtype, rt.device)
    if args.ops_only:
        return _finish(ok, args.json)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, dtype)
    model.to(rt.device)
    m = cfg.model
    ds = build_dataset(m, cfg.data, cfg.train.seq_length)
    samples, used = [], 0
    for i in range(64):
        s = ds[i]
        if used + len(s["input_ids"]) > cfg.train.seq_length:
            break
        samples.append(s)
        used += len(s["input_ids"])
    batch = pack_thd(samples, cfg.train.seq_length, m.pad_token_id, m.vision_token_ids, m.vision.spatial_merge_size)
    batch = to_device(batch, rt.device, dtype, row_extras=get_model_family(m.name).packed_row_extras)
    gdns = [mod for mod in model.modules() if isinstance(mod, Qwen35GatedDeltaNet)]
    tol_loss, tol_grad = (5e-2, 5e-2) if dtype == torch.bfloat16 else (1e-3, 1e-3)

    CoreAttention.backend = "sdpa"
    for g in gdns:
        g.kernel_backend = "torch"
    reference = run(model, batch)
    for g in gdns:
        g.kernel_backend = "fla"
    ok &= compare("gdn fla vs torch", run(model, batch), reference, tol_loss, tol_grad)
    if dtype == torch.bfloat16:
        for g in gdns:
            g.kernel_backend = "torch"
        CoreAttention.backend = "varlen"
        ok &= compare("attention varlen vs sdpa", run(model, batch), reference, tol_loss, tol_grad)
    return _finish(ok, args.json)


def _finish(ok: bool, json_path: str | None) -> int:
    if json_path:
        Path(json_path).write_text(json.dumps(RESULTS, indent=1))
    return 0 if ok else 1


@pytest.mark.gpu
def test_fast_kernel_paths_give_the_reference_loss_and_gradients(run_check):
    """fla GDN and varlen attention give the PyTorch references' loss and gradients (proxy recipe)."""
    run_check(__file__)


if __name__ == "__main__":
    sys.exit(main())
