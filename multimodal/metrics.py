"""Where metrics go: console (with a progress bar), metrics.jsonl, TensorBoard, W&B. Rank 0 only."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

JSONL_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_peak_gib")


class MetricsSink:
    def __init__(self, cfg, enabled: bool, total_iters: int, start_iter: int, config_dict: dict):
        self.enabled = enabled
        self.interval = cfg.interval
        self.jsonl = self.tb = self.wandb = self.bar = None
        if not enabled:
            return
        out = Path(cfg.dir)
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "metrics.jsonl", "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb=true needs `pip install -e .[wandb]`") from e
            os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(out), config=config_dict)
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_iters, initial=start_iter, unit="step", dynamic_ncols=True, leave=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {k: _clean(metrics.get(k)) for k in JSONL_KEYS}
        row.update({k: _clean(v) for k, v in metrics.items() if k not in row})
        self.jsonl.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if v is not None}, step=step)
        line = (
            f"step {step:6d} | loss {row['loss']:.4f} | grad_norm {row['grad_norm']:.3f} | lr {row['lr']:.2e} | "
            f"{row['tokens_per_s']:.0f} tok/s | {row['tflops_per_gpu']:.3g} TFLOP/s/GPU | "
            f"mfu {_fmt(row['mfu'])} | peak mem {row['mem_peak_gib']:.2f} GiB"
        )
        if self.bar is not None:
            self.bar.write(line)
        else:
            log.info(line)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        for h in (self.bar, self.tb):
            if h is not None:
                h.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None if math.isnan(v) else v
    return v


def _fmt(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"
