"""Write a synthetic Qwen3.5(-MoE) Hugging Face checkpoint of any depth (random bf16 weights, the
released layout: config.json, model-0000K-of-0000N.safetensors, index), shard by shard in bounded
memory: for timing and sizing conversions without downloading a release.

    python scripts/make_synthetic_hf.py --out /tmp/moe16 --layers 16 --hidden 1024 --experts 64
    python scripts/make_synthetic_hf.py --out /tmp/a3b4 --config configs/qwen35_vl_35b_a3b.yaml --layers 4
    python scripts/make_synthetic_hf.py --out /tmp/a3b4e64 --config configs/qwen35_vl_35b_a3b.yaml --layers 4 \
        model.num_experts=64      # the recipe's shapes with overrides: here one EP=4 rank's experts
"""

from __future__ import annotations

import argparse
import sys

from core import console

console.quiet_dependency_warnings("--verbose" in sys.argv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", help="take the shapes from this recipe's model section (--layers, --mtp still apply)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64, help="0: a dense model")
    ap.add_argument("--moe-ffn", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=3072, help="dense MLP width (--experts 0)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--mtp", type=int, default=1, help="MTP layers (the released checkpoints have 1)")
    ap.add_argument("--shard-size", default="2GB")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("overrides", nargs="*", help="with --config: section.key=value, as for training")
    args = ap.parse_args(argv)

    import dataclasses

    from core.safetensors_io import parse_size
    from models import get_hf_adapter, get_model_family
    from multimodal.hf_convert import init_single_process, write_random_hf

    init_single_process()
    if args.overrides and not args.config:
        ap.error("overrides (section.key=value) apply to a recipe: give --config")
    if args.config:
        from multimodal.config import load_config

        m = load_config(args.config, args.overrides).model
        m = dataclasses.replace(m, num_layers=args.layers, mtp_num_layers=args.mtp, hf_config=None)
        family = get_model_family(m.name)
        stats = write_random_hf(m, get_hf_adapter(family), family, args.out, max_shard_bytes=parse_size(args.shard_size))
        print(f"{args.out}: {stats['tensors']} tensors, {stats['shards']} shard(s), {stats['bytes'] / 2**30:.2f} GiB")
        return 0
    family = get_model_family("qwen35_vl")
    base = family.config_class()
    m = dataclasses.replace(
        base, hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=8, num_query_groups=2,
        head_dim=128, ffn_hidden_size=args.ffn, vocab_size=args.vocab, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=args.experts,
        moe_router_topk=min(8, args.experts) if args.experts else 2, moe_ffn_hidden_size=args.moe_ffn,
        moe_shared_expert_intermediate_size=args.moe_ffn if args.experts else 0, tie_word_embeddings=False,
        mrope_section=[6, 5, 5], mtp_num_layers=args.mtp,
        vision=dataclasses.replace(base.vision, depth=2, hidden_size=256, intermediate_size=1024, num_heads=4))
    family = get_model_family(m.name)
    stats = write_random_hf(m, get_hf_adapter(family), family, args.out, max_shard_bytes=parse_size(args.shard_size))
    print(f"{args.out}: {stats['tensors']} tensors, {stats['shards']} shard(s), {stats['bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
