"""Convert between Hugging Face checkpoints and ours, through the model family's Hugging Face
adapter (``ModelFamily.hf_adapter``; Qwen3.5 and Qwen3.5-MoE have one, a family without one is
refused in one line).

    python scripts/convert_hf.py import --hf-dir DIR --out CKPT [--tp N --pp N --ep N]
    python scripts/convert_hf.py export --ckpt CKPT --out DIR [--config RECIPE.yaml] [--merge-lora]

import writes a weights-only megatron dist-checkpoint (iter_0000000 + latest) that training
loads with ``checkpoint.load=CKPT`` and ``model.hf_config=DIR`` (the shapes come from DIR's
config.json). A dist-checkpoint is layout independent: the same files load under any TP/PP/EP,
so --tp/--pp/--ep only check that the layout you plan divides the model. The family is the one
whose ``hf_model_types`` lists DIR's config.json ``model_type``.

export loads any of our checkpoints (weights-only or a training checkpoint, saved under any
TP/EP layout) into one process and writes model.safetensors + config.json that
``from_pretrained`` loads. The model shapes come from the checkpoint (written at import or by
training), or from --config; the family from the ``name`` of that model section.

A checkpoint of a LoRA run (``model.lora``) exports with --merge-lora: each adapter is folded
into its base weight (W + alpha/rank * B @ A, in fp32) and the result is a plain HF checkpoint
whose logits equal the LoRA model's. The LoRA settings come from --config, else from the
checkpoint's model_config.json. Exporting such a checkpoint without --merge-lora is refused.
--adapter-only writes just the adapters as a PEFT LoRA adapter (adapter_config.json +
adapter_model.safetensors, HF module names: a fused layer of ours becomes each HF module it
holds, with the same A and that module's rows of B) to load with
``peft.PeftModel.from_pretrained`` on top of the base HF checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from core import console

# before torch and megatron are imported: their import-time warnings are held back too
console.quiet_dependency_warnings("--verbose" in sys.argv)

import torch  # noqa: E402

from core.errors import ConfigError, one_line  # noqa: E402
from core.safetensors_io import SafetensorsFolder, parse_size  # noqa: E402
from models import DEFAULT_MODEL, family_for_hf_config, get_hf_adapter, get_model_family  # noqa: E402
from models.common.model_config import LoRAConfig, ModelConfig  # noqa: E402
from models.common.parallel_config import ParallelConfig  # noqa: E402
from multimodal.config import load_config, validate_layout  # noqa: E402

MODEL_CONFIG_FILE = "model_config.json"
HF_CONFIG_FILE = "hf_config.json"
DEFAULT_SHARD = "5GB"
log = logging.getLogger("convert_hf")


def _init():
    from multimodal.hf_convert import init_single_process

    init_single_process()


def _build(m: ModelConfig):
    return get_model_family(m.name).build(m, ParallelConfig(), torch.float32)


def do_import(hf_dir: str, out: str, tp: int, pp: int, ep: int, workers: int = 1) -> Path:
    from multimodal import hf_convert

    family = family_for_hf_config(hf_dir)
    hf = get_hf_adapter(family)
    m = hf.model_config_from_hf(hf_dir)
    validate_layout(m, ParallelConfig(tp=tp, pp=pp, ep=ep))
    if m.num_layers % pp:
        raise ValueError(f"--pp {pp} does not divide the {m.num_layers} decoder layers")
    _init()
    final, stats = hf_convert.import_hf(hf_dir, out, hf, family, workers)
    log.info("imported %d tensors, %.2f GB in %.1f s (%.2f GB/s) -> %s", stats["tensors"], stats["bytes"] / 1e9,
             stats["seconds"], stats["gb_per_s"], final)
    return final


def _recorded_model_config(ckpt: Path) -> dict | None:
    path = ckpt / MODEL_CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def model_config_of_checkpoint(ckpt: Path, recipe: str | None) -> ModelConfig:
    """The architecture of a checkpoint: --config, else what the checkpoint recorded (its HF
    config.json when it has one, read by the family its model_config.json names)."""
    if recipe:
        return load_config(recipe).model
    recorded = _recorded_model_config(ckpt)
    has_hf = (ckpt / HF_CONFIG_FILE).is_file()
    if recorded is None and not has_hf:
        raise FileNotFoundError(f"{ckpt} records no model config; pass --config RECIPE.yaml")
    if recorded is not None:
        family = get_model_family(recorded.get("name") or DEFAULT_MODEL)
    else:
        family = family_for_hf_config(ckpt / HF_CONFIG_FILE)
    from multimodal.recipe_reader import build_section as build_dataclass

    base = build_dataclass(family.config_class, recorded, "model.") if recorded is not None else None
    if has_hf:  # the shapes from the HF config; what the run chose (model.mtp_num_layers) from the record
        return get_hf_adapter(family).model_config_from_hf(ckpt / HF_CONFIG_FILE, base=base)
    return base


def lora_config_of_checkpoint(ckpt: Path, recipe: str | None):
    """The ``model.lora`` a checkpoint was trained with: --config, else its model_config.json."""
    from multimodal.recipe_reader import build_section as build_dataclass

    if recipe:
        lora = load_config(recipe).model.lora
    elif (ckpt / MODEL_CONFIG_FILE).is_file():
        raw = json.loads((ckpt / MODEL_CONFIG_FILE).read_text()).get("lora") or {}
        lora = build_dataclass(LoRAConfig, raw, "model.lora.")
    else:
        raise FileNotFoundError(f"{ckpt} records no model config; pass --config RECIPE.yaml (its model.lora)")
    if not lora.rank:
        raise ValueError(f"--merge-lora: model.lora.rank is 0 for {ckpt}; pass --config with the run's model.lora")
    return lora


def _write_peft_adapter(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], lora, outd: Path) -> Path:
    """A PEFT LoRA adapter: adapter_config.json (target_modules: a regex of exactly these HF
    modules) + adapter_model.safetensors (``base_model.model.<module>.lora_A/B.weight``, fp32)."""
    import re

    from core.safetensors_io import write_shard

    tensors = {}
    for module, (a, b) in adapters.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().float().clone()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().float().clone()
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "target_modules": "^(?:" + "|".join(re.escape(k) for k in sorted(adapters)) + ")$"}
    outd.mkdir(parents=True, exist_ok=True)
    write_shard(outd / "adapter_model.safetensors", tensors)
    (outd / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return outd


def _source_folder(path: Path) -> SafetensorsFolder | None:
    """The HF folder a checkpoint came from (model.hf_config, or the import's source), if still there."""
    trainer = json.loads((path / "trainer_state.json").read_text())
    recorded = _recorded_model_config(path) or {}
    for candidate in (recorded.get("hf_config"), trainer.get("source")):
        if candidate and Path(candidate).is_dir():
            try:
                return SafetensorsFolder(candidate)
            except FileNotFoundError:
                continue
    return None


def _export_in_memory(path: Path, m, hf, out: str, recipe: str | None, target, merge_lora: bool,
                      adapter_only: bool) -> Path:
    """LoRA exports: the model with its adapters, in one process (LoRA runs fit one host)."""
    from core.safetensors_io import write_shard
    from models.common.lora import merged_state_dict
    from multimodal import checkpointing
    from multimodal.lora import apply_lora

    model = _build(m)
    lora = lora_config_of_checkpoint(path, recipe)
    apply_lora(model, lora)
    checkpointing.load_weights(path, model)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if adapter_only:
        return _write_peft_adapter(hf.lora_to_hf(state, m), lora, Path(out))
    state = merged_state_dict(state, lora.alpha / lora.rank)
    weights = {k: t.detach().to(target or t.dtype).contiguous() for k, t in hf.ours_to_hf(state, m).items()}
    if m.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)
    write_shard(outd / "model.safetensors", weights)
    return outd


def do_export(ckpt: str, out: str, recipe: str | None, dtype: str, merge_lora: bool = False,
              adapter_only: bool = False, workers: int = 1, shard_size: str | None = None,
              drop_mtp: bool = False) -> Path:
    from megatron.core import dist_checkpointing

    from models.common.lora import is_adapter_param
    from multimodal import checkpointing, hf_convert

    path = checkpointing.resolve(ckpt, None)
    m = model_config_of_checkpoint(path, recipe)
    family = get_model_family(m.name)
    hf = get_hf_adapter(family)  # before anything is built: a family without one is refused
    _init()
    has_adapters = any(is_adapter_param(k) for k in dist_checkpointing.load_tensors_metadata(str(path)))
    if has_adapters and not (merge_lora or adapter_only):
        raise ValueError(f"{path} holds LoRA adapters: pass --merge-lora to fold them into the exported weights "
                         "(or --adapter-only for a PEFT adapter)")
    if (merge_lora or adapter_only) and not has_adapters:
        raise ValueError(f"--merge-lora / --adapter-only: {path} holds no LoRA adapters")
    trainer = json.loads((path / "trainer_state.json").read_text())
    recorded = trainer.get("hf_dtype")
    target = {"fp32": torch.float32, "bf16": torch.bfloat16,
              "auto": getattr(torch, recorded) if recorded else None}[dtype]
    if (path / HF_CONFIG_FILE).is_file():  # keep the original config (tokens, extra fields) verbatim
        cfg = json.loads((path / HF_CONFIG_FILE).read_text())
    else:
        cfg = hf.hf_config_from_ours(m)
    source = _source_folder(path)
    text = cfg.get("text_config", cfg)
    source_mtp = int(text.get("mtp_num_hidden_layers", 0) or 0)
    ours_mtp = int(getattr(m, "mtp_num_layers", 0) or 0)
    carry = None
    if source_mtp and not ours_mtp:
        mtp_in_source = source is not None and any(n.startswith("mtp.") for n in source.names)
        if mtp_in_source and not drop_mtp:
            carry = source
            log.info("the MTP head was not trained here (model.mtp_num_layers=0): its %d tensors are copied "
                     "unchanged from %s", sum(n.startswith("mtp.") for n in source.names), source.path)
        elif drop_mtp:
            text["mtp_num_hidden_layers"] = 0
            log.warning("--drop-mtp: the export has no MTP head (config.json mtp_num_hidden_layers=0)")
        else:
            raise ValueError(f"{path} has no MTP weights (model.mtp_num_layers=0) and the Hugging Face folder they "
                             "came from is not at hand to copy them from; export with --drop-mtp to write a "
                             "checkpoint without the MTP head, or keep the source folder at its recorded path")
    if merge_lora or adapter_only:
        outd = _export_in_memory(path, m, hf, out, recipe, target, merge_lora, adapter_only)
        if adapter_only:
            return outd
        stats = None
    else:
        shard = parse_size(shard_size) if shard_size else (source.largest_file() if source is not None
                                                           else parse_size(DEFAULT_SHARD))
        stats = hf_convert.export_hf(path, out, m, hf, family, target, cfg, max(shard, 1), workers, carry)
    outd = Path(out)
    from torch.distributed.checkpoint import FileSystemReader

    stored = {str(v.properties.dtype).replace("torch.", "") for v in
              FileSystemReader(str(path)).read_metadata().state_dict_metadata.values() if hasattr(v, "properties")}
    cfg["dtype"] = str(target).replace("torch.", "") if target is not None else sorted(stored)[0]
    (outd / "config.json").write_text(json.dumps(cfg, indent=2))
    if source is not None:
        copied = hf_convert.copy_processor_files(source.path, outd)
        if copied:
            log.info("copied %s from %s", ", ".join(copied), source.path)
    if stats is not None:
        _check_nothing_dropped(outd, source, drop_mtp, hf)
        log.info("exported %d tensors in %d shard(s), %.2f GB in %.1f s (%.2f GB/s) -> %s", stats["tensors"],
                 stats["shards"], stats["bytes"] / 1e9, stats["seconds"], stats["gb_per_s"], outd)
    return outd


def _check_nothing_dropped(outd: Path, source: SafetensorsFolder | None, drop_mtp: bool, hf) -> None:
    """Every tensor of the source checkpoint is in the export (the same names, or transformers'
    fused expert names for the same weights)."""
    if source is None:
        return
    written = set(SafetensorsFolder(outd).names)
    fused = hf.fused_experts(source.names)
    lost = [n for n in source.names if n not in written and not (drop_mtp and n.startswith("mtp."))
            and not (fused and ".mlp.experts." in n)]
    if lost:
        raise ValueError(f"the export lacks {len(lost)} tensor(s) of its source {source.path}, e.g. {lost[0]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verbose", action="store_true", help="dependency warnings and the traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="HF directory -> our weights-only checkpoint")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--out", required=True)
    imp.add_argument("--tp", type=int, default=1)
    imp.add_argument("--pp", type=int, default=1)
    imp.add_argument("--ep", type=int, default=1)
    imp.add_argument("--workers", type=int, default=4, help="threads writing files in parallel")
    exp = sub.add_parser("export", help="our checkpoint -> HF directory (safetensors shards + index + config.json)")
    exp.add_argument("--ckpt", required=True, help="an iter_* directory or a checkpoint dir with 'latest'")
    exp.add_argument("--out", required=True)
    exp.add_argument("--config", help="recipe whose model section describes the checkpoint")
    exp.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                     help="auto: the dtype of the imported HF checkpoint, else the checkpoint's own")
    exp.add_argument("--workers", type=int, default=4, help="shards converted and written in parallel")
    exp.add_argument("--shard-size", default=None,
                     help=f"largest shard, e.g. 5GB (default: the source folder's largest file, else {DEFAULT_SHARD})")
    exp.add_argument("--drop-mtp", action="store_true",
                     help="write no MTP head when this checkpoint has none and its source folder is gone")
    exp.add_argument("--merge-lora", action="store_true",
                     help="fold the LoRA adapters of a model.lora run into the base weights")
    exp.add_argument("--adapter-only", action="store_true",
                     help="write only the LoRA adapters, as a PEFT adapter (HF module names) for the base checkpoint")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    try:
        if args.cmd == "import":
            print(do_import(args.hf_dir, args.out, args.tp, args.pp, args.ep, args.workers))
        else:
            print(do_export(args.ckpt, args.out, args.config, args.dtype, args.merge_lora, args.adapter_only,
                            args.workers, args.shard_size, args.drop_mtp))
    except (ConfigError, ValueError, KeyError, FileNotFoundError, PermissionError) as e:
        # what the user can fix (a family without an adapter, an unmapped tensor, a missing file): one line
        if args.verbose:
            import traceback

            traceback.print_exc()
        _held_summary()
        print(f"error: {one_line(e)}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    _held_summary()
    return 0


def _held_summary() -> None:
    held = console.summary()
    if held:
        log.info(held)

if __name__ == "__main__":
    sys.exit(main())
