"""``model.lora``: LoRA adapters on the language model's linear layers, base weights frozen.

Applied once to the built model, before megatron's DDP and optimizer (like ``model.freeze``):
every base weight gets ``requires_grad=False`` (no gradient buffer, no fp32 main copy, no Adam
moments); only the adapters' A and B train, in fp32 main params as usual. The adapter layer
itself is ``models/common/lora.py``.

Targets name the layers of a decoder layer: linear_qkv / linear_proj (full attention), in_proj /
out_proj (GDN), linear_fc1 / linear_fc2 (dense MLP), shared_experts (the MoE shared expert's
fc1 and fc2). Routed experts are refused (their weights are one grouped tensor per layer).

Any tensor / pipeline / context-parallel layout: each adapter splits over TP the way its base
layer does (models/common/lora.py) and is stored in checkpoints as the full matrix, so a run,
its weights and the HF / PEFT export do not depend on the layout; A is drawn per layer from
(the run's seed, the layer's global name), so every layout starts from the same adapters.
"""

from __future__ import annotations

import re

import torch

from models.common.lora import add_adapter, is_adapter_param, shard_adapters

# target -> the module path inside a decoder layer
TARGETS = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "in_proj": "self_attention.in_proj",
    "out_proj": "self_attention.out_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
    "shared_experts": ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"),
}
_LAYER = re.compile(r"^language_model\.decoder\.layers\.\d+\.(.+)$")
# the MTP head's decoder layer (model.mtp_num_layers) gets the same adapters as the decoder's
_MTP_LAYER = re.compile(r"^language_model\.mtp\.layers\.\d+\.transformer_layer\.(.+)$")


def check_lora(lora) -> str | None:
    """Why this ``model.lora`` cannot run (None when it can); the text starts with the field."""
    if lora.rank < 0:
        return f"rank must be >= 0 (0 = off), got {lora.rank}"
    if lora.alpha <= 0:
        return f"alpha must be > 0, got {lora.alpha}"
    if not 0 <= lora.dropout < 1:
        return f"dropout must be in [0, 1), got {lora.dropout}"
    if not lora.targets:
        return f"targets is empty; choose from {list(TARGETS)}"
    if "experts" in lora.targets:
        return ("targets: routed experts (experts) are not supported (one grouped weight per layer); "
                "use shared_experts and the attention / GDN projections")
    unknown = sorted(set(lora.targets) - set(TARGETS))
    if unknown:
        return f"targets: unknown {unknown}; choose from {list(TARGETS)}"
    return None


def _wanted(targets: list[str]) -> set[str]:
    out = set()
    for t in targets:
        paths = TARGETS[t]
        out.update((paths,) if isinstance(paths, str) else paths)
    return out


def apply_lora(model: torch.nn.Module, lora, seed: int | None = None) -> str:
    """Add the adapters of ``lora`` (a LoRAConfig with rank > 0) to ``model`` (one pipeline stage,
    any TP) and freeze every other weight; returns the log line (adapted layers, trainable
    parameters). ``seed`` (default: torch's initial seed, which seed_everything sets to the
    run's seed on every rank) seeds each layer's A with the layer's global name."""
    if seed is None:
        seed = torch.initial_seed()
    wanted = _wanted(lora.targets)
    layers = model.language_model.decoder.layers if getattr(model, "language_model", None) is not None else []
    adapted = 0
    for name, m in list(model.named_modules()):
        hit = _LAYER.match(name) or _MTP_LAYER.match(name)
        if not hit or hit.group(1) not in wanted:
            continue
        if name.startswith("language_model.mtp."):  # one MTP head per model: its name is global
            layer = model.get_submodule(name[:name.index(".transformer_layer.")] + ".transformer_layer")
            global_name = name
        else:
            layer = layers[int(name.split(".")[3])]
            global_name = f"language_model.decoder.layers.{layer.layer_number - 1}.{hit.group(1)}"
        add_adapter(m, lora.rank, lora.alpha, lora.dropout, global_name, seed)
        if not getattr(layer, "_lora_sharded", False):  # the split matrices stored like their base weights
            layer.sharded_state_dict = _with_sharded_adapters(layer.sharded_state_dict)
            layer._lora_sharded = True
        adapted += 1
    trainable = total = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
        trainable += p.numel() if p.requires_grad else 0
        total += p.numel()
    return (f"LoRA rank {lora.rank} alpha {lora.alpha} on {adapted} layers ({', '.join(lora.targets)}): "
            f"trainable parameters on this rank {trainable:,} of {total:,} (base weights frozen)")


def _with_sharded_adapters(sharded_state_dict):
    def wrapped(*args, **kwargs):
        return shard_adapters(sharded_state_dict(*args, **kwargs))

    return wrapped
