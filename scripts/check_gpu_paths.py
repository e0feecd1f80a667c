"""On a GPU: the fast kernel paths give the same loss and gradients as the PyTorch references.

Builds a recipe's model on CUDA, runs the same packed mock batch with
  (a) GDN ops on flash-linear-attention vs the PyTorch reference, and
  (b) attention through varlen flash attention vs SDPA with a block-diagonal mask,
and prints one JSON line per comparison (max abs diff of per-token loss, max relative
grad-norm diff over parameters). Exit code 1 if a difference exceeds the tolerance.

    python scripts/check_gpu_paths.py --config configs/qwen35_vl_proxy.yaml [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.collate import pack_thd  # noqa: E402
from data.loader import build_dataset  # noqa: E402
from models import get_model_builder  # noqa: E402
from models.qwen35_vl.attention import CoreAttention  # noqa: E402
from models.qwen35_vl.gdn import Qwen35GatedDeltaNet  # noqa: E402
from multimodal.config import load_config  # noqa: E402
from multimodal.forward_step import packed_seq_params, to_device  # noqa: E402
from multimodal.platform import init_distributed, seed_everything  # noqa: E402


def run(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                 packed_seq_params=packed_seq_params(batch))
    (loss * batch["loss_mask"]).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def compare(name, a, b, tol_loss, tol_grad):
    loss_diff = (a[0] - b[0]).abs().max().item()
    rel = max(((a[1][k] - b[1][k]).norm() / (b[1][k].norm() + 1e-12)).item() for k in b[1])
    ok = loss_diff <= tol_loss and rel <= tol_grad
    print(json.dumps({"check": name, "max_abs_loss_diff": loss_diff, "max_rel_grad_diff": rel, "ok": ok}))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen35_vl_proxy.yaml")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
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
    batch = pack_thd(samples, cfg.train.seq_length, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size)
    batch = to_device(batch, rt.device, dtype)
    gdns = [mod for mod in model.modules() if isinstance(mod, Qwen35GatedDeltaNet)]
    tol_loss, tol_grad = (5e-2, 5e-2) if dtype == torch.bfloat16 else (1e-3, 1e-3)
    ok = True

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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
