"""Selective activation recompute (``train.recompute_modules``), applied to a built model.

Modules:
- ``layernorm`` (the layer's input and pre-MLP RMSNorms) and the mixers' own blocks, which each
  model family installs through ``ModelFamily.mixer_checkpoints`` (Qwen3.5: ``gdn_qkv``,
  ``gdn_norm_out``, models/qwen35_vl/layer_hooks.py): ours, discard-output checkpointing. The
  block runs without autograd in forward; its outputs are consumed as usual and, once the mixer
  (or the MLP) has returned, their storage is freed; a gradient hook on the mixer's (MLP's) output
  regenerates them into the same storage before any backward reads them. The blocks of one
  half-layer depend on each other (input norm -> mixer input block -> mixer output norm), so one
  manager per layer replays them from one hook in forward order. megatron-core 0.19.2 has the
  same idea (``CheckpointWithoutOutput``), but its default constructor takes the
  transformer-engine FP8 path (``fp8 is not None`` with fp8=False) and it compiles a C++
  extension at run time to alias the storage; ours copies the regenerated block into the freed
  storage instead (one memcpy of the block, no compiler needed).
- ``core_attn``, ``shared_experts``: megatron's own selective recompute of those modules
  (``tensor_parallel.checkpoint``: the block's internals are recomputed in backward).
- ``moe_act``: the routed experts' weighted SwiGLU (models/common/grouped_experts.py): the
  experts keep fc1's output and regenerate the activation in backward from it, with the same
  kernel, so the result is the same bits; saves [tokens x top-k, moe_ffn_hidden_size] per layer.

Flags are set on the built modules rather than through TransformerConfig so the choice stays
in the training recipe (``train``) and needs no change to the model builders. Recompute is
deterministic, so outputs and every gradient equal the run without it bit for bit
(tests/test_recompute.py).
"""

from __future__ import annotations

import torch

from core import compat
from models import MODEL_REGISTRY, get_model_family
from models.family import MixerCheckpoints

# what the trainer installs itself on megatron's modules; the rest are the families' mixers'
MEGATRON_MODULES = ("core_attn", "layernorm", "shared_experts", "moe_act")
MOE_MODULES = ("moe_act", "shared_experts")


def known_modules() -> list[str]:
    """Every ``train.recompute_modules`` entry some registered family has."""
    return list(dict.fromkeys(name for f in MODEL_REGISTRY.values() for name in f.recompute_modules))


def check_modules(modules: list[str], cp: int = 1) -> str | None:
    """Why this request cannot run (None when it can)."""
    known = known_modules()
    unknown = sorted(set(modules) - set(known))
    if unknown:
        return f"unknown recompute module(s) {unknown}; choose from {known}"
    no_cp = [name for f in MODEL_REGISTRY.values() for name in f.recompute_modules_no_cp if name in modules]
    if cp > 1 and no_cp:
        return f"{' / '.join(no_cp)} recompute is not implemented with context parallelism (parallel.cp > 1)"
    return None


def sweep_choices(model_cfg) -> list[list[str]]:
    """The recompute choices a memory sweep compares: none, each module this model has alone (the
    MoE ones only with experts), then all of them together."""
    has = get_model_family(model_cfg.name).recompute_modules
    shared = getattr(model_cfg, "moe_shared_expert_intermediate_size", 0)
    usable = [name for name in has if name not in MOE_MODULES
              or (model_cfg.num_experts and (name != "shared_experts" or shared))]
    choices = [[], *([name] for name in usable)]
    choices.append(sorted(usable))
    return choices


def apply_recompute(model: torch.nn.Module, modules: list[str], model_name: str | None = None) -> int:
    """Turn on recompute for ``modules`` in every decoder layer of ``model``; returns the number
    of blocks changed. The mixers' own blocks are installed by their family
    (``ModelFamily.mixer_checkpoints``): ``model_name``'s, else every registered family, each of
    which recognises its own mixers."""
    reason = check_modules(list(modules))
    if reason:
        raise ValueError(reason)
    _cpu_rng_shim()
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    families = [get_model_family(model_name)] if model_name else list(MODEL_REGISTRY.values())
    mixer_modules = [name for name in modules if name not in MEGATRON_MODULES]
    changed = 0
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        mixer = layer.self_attention
        if "core_attn" in modules and isinstance(mixer, Attention):
            mixer.checkpoint_core_attention = True
            changed += 1
        if "shared_experts" in modules and isinstance(layer.mlp, MoELayer) and layer.mlp.shared_experts is not None:
            layer.mlp.shared_experts_recompute = True
            changed += 1
        if "moe_act" in modules and isinstance(layer.mlp, MoELayer) and hasattr(layer.mlp.experts, "recompute_act"):
            layer.mlp.experts.recompute_act = True
            changed += 1
        if "layernorm" in modules or mixer_modules:
            manager = _LayerRecompute(layer, "layernorm" in modules)
            changed += 2 * ("layernorm" in modules)
            if mixer_modules:
                changed += sum(f.mixer_checkpoints(mixer, mixer_modules, manager) for f in families)
    return changed


def _cpu_rng_shim() -> None:
    """megatron's checkpoint (core_attn, shared_experts) saves and restores the CUDA RNG state;
    without a GPU there is none and torch.cuda.get_rng_state would fail. The CPU generator and
    the (CPU) RNG tracker are still saved and restored by megatron as usual."""
    if torch.cuda.is_available():
        return
    compat.replace(compat.GET_CUDA_RNG_STATE, lambda *a, **k: None)
    compat.replace(compat.SET_CUDA_RNG_STATE, lambda *a, **k: None)


class _Replay(torch.autograd.Function):
    """Runs ``fn`` without building a graph; backward replays it (see _DiscardCheckpoint)."""

    @staticmethod
    def forward(ctx, fn, ckpt, *args):
        with torch.no_grad():
            out = fn(*args)
        ctx.save_for_backward(*args)
        ckpt.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, *grads):
        outputs, inputs = ctx.replayed
        ctx.replayed = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(i.grad if i.requires_grad else None for i in inputs)


class _DiscardCheckpoint:
    """One block: run without a graph, free its outputs' storage, regenerate them on demand.

    The blocks recomputed here draw no random numbers (they hold no dropout), so no RNG state
    is saved; the replay is the same computation on the same inputs, hence bit-identical."""

    def __init__(self, fn, *args):
        self.fn, self.ctx = fn, None
        out = _Replay.apply(fn, self, *args)
        self.outputs = out if isinstance(out, tuple) else (out,)
        self.result = out

    def discard(self) -> None:
        for t in self.outputs:
            t.untyped_storage().resize_(0)

    def replay(self) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is None:  # already replayed (several hooks can lead here)
            return
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = self.fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        for old, new in zip(self.outputs, out):
            storage = old.untyped_storage()
            if storage.nbytes() == 0:  # outputs that share one storage are restored once
                storage.resize_(new.untyped_storage().nbytes())
                storage.copy_(new.untyped_storage())
        ctx.replayed = (out, inputs)
        self.outputs = ()


def _wrap_forward(module, wrapper) -> None:
    """Shadow ``module.forward`` with ``wrapper(original_forward, *args, **kwargs)`` (instance
    attribute: parameters, state_dict and the class are untouched)."""
    original = module.forward
    module.forward = lambda *a, **k: wrapper(original, *a, **k)


class _LayerRecompute(MixerCheckpoints):
    """The discard-output blocks of one TransformerLayer and the hooks that replay them; the
    ``MixerCheckpoints`` its family's mixer blocks are installed through."""

    def __init__(self, layer, norm: bool):
        self.layer = layer
        self.attn_half: list[_DiscardCheckpoint] = []  # input norm, then the mixer's blocks (forward order)
        self.mlp_half: list[_DiscardCheckpoint] = []  # pre-MLP norm
        layer._recompute = self
        if norm:
            _wrap_forward(layer.input_layernorm, lambda f, x: self._checkpoint(self.attn_half, f, x))
            _wrap_forward(layer.pre_mlp_layernorm, lambda f, x: self._checkpoint(self.mlp_half, f, x))
            layer.mlp.register_forward_hook(self._after(self.mlp_half))
        layer.self_attention.register_forward_hook(self._after(self.attn_half))

    def active(self) -> bool:
        return self.layer.training and torch.is_grad_enabled()

    def checkpoint(self, fn, *args):
        return self._checkpoint(self.attn_half, fn, *args)

    def _checkpoint(self, blocks, fn, *args):
        if not self.active():
            return fn(*args)
        ckpt = _DiscardCheckpoint(fn, *args)
        blocks.append(ckpt)
        return ckpt.result

    def _after(self, blocks: list):
        def hook(module, inputs, output):
            if not blocks:
                return
            pending = list(blocks)
            blocks.clear()
            for ckpt in pending:  # every consumer has run
                ckpt.discard()
            target = output[0] if isinstance(output, tuple) else output
            if not target.requires_grad:
                return

            def replay(_grad):
                for ckpt in pending:  # forward order
                    ckpt.replay()

            target.register_hook(replay)

        return hook
