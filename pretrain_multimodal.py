"""Train a vision-language model from a YAML recipe.

    python pretrain_multimodal.py --config configs/qwen35_vl_proxy.yaml [section.key=value ...]
    torchrun --nproc-per-node 8 pretrain_multimodal.py --config configs/qwen35_vl_2b.yaml
    python pretrain_multimodal.py --config configs/qwen35_vl_proxy.yaml --print-config
    python pretrain_multimodal.py --config configs/qwen35_vl_397b_a17b.yaml --dry-run [--world-size N]

A fault the user can fix (a recipe field, a missing or truncated checkpoint, a full disk, bad
data files, a diverged run) ends with one line ``error: ...`` and exit code 2; its traceback is
in <logging.dir>/error.log (and on the console with --verbose). See docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

from core import console

# before torch and megatron are imported: their import-time warnings are held back too
console.quiet_dependency_warnings("--verbose" in sys.argv)

from core.errors import ConfigError, TrainingError, one_line  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    # imported here, not at the top: a process that multiprocessing spawns (megatron's asynchronous
    # checkpoint writer and its results queue) re-runs this file's top level, and would otherwise
    # import torch and megatron again before doing anything
    from multimodal.config import config_to_yaml, load_config, resolve_sources, validate  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML recipe under configs/")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the parallel layout and print parameters + memory per GPU, no GPU needed")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--dry-run: GPUs to lay out (default: parallel.world_size of the recipe)")
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0,
                        help="--dry-run: GiB per GPU to fit in (H100 80GB: 80; H200 141GB = 131 GiB)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the full traceback of a reported error on the console too, and every "
                             "dependency warning (otherwise counted in one line at the end)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.iters=100 parallel.tp=2")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the options
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
    )
    # megatron-core logs every parameter name and its full optimizer config at INFO.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    cfg = None
    try:
        cfg = resolve_sources(load_config(args.config, args.overrides))
        if args.dry_run:
            from multimodal.dry_run import dry_run

            return dry_run(cfg, args.world_size, args.gpu_mem_gib, config_path=args.config)
        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if args.print_config:
            print(config_to_yaml(cfg), end="")
            return 0
        from multimodal.training import train

        try:
            train(cfg)
        finally:
            held = console.summary()
            if held and rank == 0:
                logging.getLogger("pretrain_multimodal").info(held)
    except KeyboardInterrupt:  # before the step loop (it reports its own step)
        print("stopped: interrupted (SIGINT) before training started; nothing was trained", file=sys.stderr)
        return 130
    except TrainingError as e:
        # a refused recipe (and anything a dry run finds) happened before any run: its one line is
        # the whole story, and no run directory should appear for it
        ran = cfg is not None and not args.dry_run and not isinstance(e, ConfigError)
        return report(e, rank, cfg.logging.dir if ran else None, args.verbose)
    return 0


def report(e: TrainingError, rank: int, log_dir: str | None, verbose: bool) -> int:
    """One line on the console; the traceback in <logging.dir>/error.log (or here with --verbose)."""
    trace = "".join(traceback.format_exception(e))
    saved = None
    if log_dir is not None:
        try:
            path = Path(log_dir) / ("error.log" if rank == 0 else f"error_rank{rank}.log")
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(trace)
            saved = path
        except OSError:  # a full disk must not hide the message itself
            saved = None
    if verbose:
        print(trace, file=sys.stderr, end="")
    where = f" (traceback: {saved})" if saved is not None and not verbose else ""
    print(f"{e.label}: {one_line(e)}{where}", file=sys.stderr)
    return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
