"""Our model vs transformers' on the same Hugging Face checkpoint: one JSON line. The model family
is the one whose ``hf_model_types`` lists the checkpoint's config.json ``model_type`` (Qwen3.5,
Qwen3.5-MoE); its Hugging Face adapter runs the comparison.

    python scripts/hf_parity.py --hf-dir DIR [--dtype fp32|bf16] [--seed S]

Prints {"max_abs_logit_diff", "loss_abs_diff", "max_rel_grad_diff", "num_params_compared",
"position_ids_equal", ...}; exit code 1 when a threshold is exceeded (fp32: logits 1e-4, loss
1e-5, gradients 1e-3 relative). The inputs hold text and three images of different sizes.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from megatron.core import parallel_state as ps

    from core.errors import ConfigError
    from models import family_for_hf_config, get_hf_adapter
    from multimodal.platform import init_distributed

    try:
        hf = get_hf_adapter(family_for_hf_config(args.hf_dir))
    except ConfigError as e:  # an unknown model_type, a family without an adapter: one line
        print(f"hf_parity.py: {e}", file=sys.stderr)
        return e.exit_code
    init_distributed()
    ps.initialize_model_parallel(1, 1)
    result = hf.run_parity(args.hf_dir, args.dtype, args.seed)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
