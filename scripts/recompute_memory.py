"""Activation memory each selective-recompute module saves, on any device (CPU included).

    python scripts/recompute_memory.py --config configs/qwen35_vl_2b.yaml [key=value ...] [--json OUT]

For each ``train.recompute_modules`` choice (none, each module alone, all): a fresh model, one
forward of the recipe's first packed micro-batch, and the bytes autograd holds for the backward
when the forward returns (``multimodal.observability.memory.activation_bytes_held``; parameters excluded).
This is exact for the shapes given and needs no GPU; ``bench_train.py --recompute-sweep``
measures the CUDA allocator's peak instead, which adds workspaces and fragmentation.
Decoder activations grow linearly with the tokens and the layers: a CPU can run the real
widths with fewer layers and a shorter row (e.g. ``model.num_layers=4 train.seq_length=2048``:
one GDN, GDN, GDN, attention block) and scale.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch


def measure(config: str, overrides: list[str], dtype: torch.dtype) -> dict:
    from megatron.core import parallel_state as ps

    from data.loader import MicroBatchIterator, build_dataset
    from models import get_model_builder, get_model_family
    from multimodal.config import load_config, resolve_sources
    from multimodal.forward_step import packed_seq_params, to_device
    from multimodal.observability.memory import activation_bytes_held
    from multimodal.platform import init_distributed
    from core.seeding import seed_everything
    from multimodal.performance.recompute import apply_recompute, sweep_choices

    cfg = load_config(config, [*overrides, "train.cuda_graphs=false"])
    resolve_sources(cfg)
    rt = init_distributed()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    m, t = cfg.model, cfg.train
    dataset = build_dataset(m, cfg.data, t.seq_length)
    host = next(iter(MicroBatchIterator.from_config(dataset, m, cfg.data, t)))
    batch = to_device(host, rt.device, dtype, row_extras=get_model_family(m.name).packed_row_extras)
    rows = {}
    for modules in sweep_choices(m):
        seed_everything(0)
        model = get_model_builder(m.name)(m, cfg.parallel, dtype).to(rt.device)
        if modules:
            apply_recompute(model, modules)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        loss, held = activation_bytes_held(lambda: model(
            batch["tokens"], batch["position_ids"], labels=batch["labels"], pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"], packed_seq_params=packed_seq_params(batch)), params)
        rows[",".join(modules) or "none"] = {"activation_gib": held / 2**30}
        del model, loss
        gc.collect()  # the model's modules reference each other: free it before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = rows["none"]["activation_gib"]
    for row in rows.values():
        row["saved_gib"] = base - row["activation_gib"]
        row["saved_fraction"] = row["saved_gib"] / base if base else 0.0
    return {"config": config, "overrides": overrides, "dtype": str(dtype).replace("torch.", ""),
            "device": str(rt.device), "seq_length": t.seq_length, "num_layers": m.num_layers,
            "real_tokens": int(host["num_real_tokens"]), "choices": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json")
    args = ap.parse_intermixed_args(argv)
    result = measure(args.config, args.overrides, {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
    for name, row in result["choices"].items():
        print(f"  {name:45s} activations {row['activation_gib']:8.3f} GiB  saves {row['saved_gib']:7.3f} GiB "
              f"({100 * row['saved_fraction']:4.1f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
