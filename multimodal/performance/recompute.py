"""Selective activation recompute (``train.recompute_modules``), applied to a built model.

Modules:
- ``layernorm`` (the layer's input and pre-MLP RMSNorms), ``gdn_qkv`` (the whole Gated
  DeltaNet input block: ``in_proj`` + ``prepare``: conv, SiLU, l2-norm, head repeat, beta, g)
  and ``gdn_norm_out`` (the gated RMSNorm before ``out_proj``): ours, discard-output
  checkpointing. The block runs without autograd in forward; its outputs are consumed as usual
  and, once the mixer (or the MLP) has returned, their storage is freed; a gradient hook on the
  mixer's (MLP's) output regenerates them into the same storage before any backward reads
  them. The blocks of one half-layer depend on each other (input norm -> gdn_qkv -> z ->
  gdn_norm_out), so one manager per layer replays them from one hook in forward order.
  megatron-core 0.19.2 has the same idea (``CheckpointWithoutOutput``), but its default
  constructor takes the transformer-engine FP8 path (``fp8 is not None`` with fp8=False) and it
  compiles a C++ extension at run time to alias the storage; ours copies the regenerated block
  into the freed storage instead (one memcpy of the block, no compiler needed).
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

SUPPORTED = ("core_attn", "layernorm", "shared_experts", "gdn_qkv", "gdn_norm_out", "moe_act")
KNOWN = SUPPORTED


def check_modules(modules: list[str], cp: int = 1) -> str | None:
    """Why this request cannot run (None when it can)."""
    unknown = sorted(set(modules) - set(KNOWN))
    if unknown:
        return f"unknown recompute module(s) {unknown}; choose from {list(KNOWN)}"
    if cp > 1 and ("gdn_qkv" in modules or "gdn_norm_out" in modules):
        return "gdn_qkv / gdn_norm_out recompute is not implemented with context parallelism (parallel.cp > 1)"
    return None


def sweep_choices(model_cfg) -> list[list[str]]:
    """The recompute choices a memory sweep compares: none, each module this model has alone,
    then all of them together."""
    from models import get_model_family

    has = get_model_family(model_cfg.name).recompute_modules
    choices = [[], *([name] for name in ("layernorm", "gdn_qkv", "gdn_norm_out", "core_attn") if name in has)]
    if model_cfg.num_experts and "moe_act" in has:
        choices.append(["moe_act"])
    if model_cfg.num_experts and getattr(model_cfg, "moe_shared_expert_intermediate_size", 0) and "shared_experts" in has:
        choices.append(["shared_experts"])
    choices.append(sorted({m for c in choices for m in c}))
    return choices


def apply_recompute(model: torch.nn.Module, modules: list[str], model_name: str | None = None) -> int:
    """Turn on recompute for ``modules`` in every decoder layer of ``model``; returns the number
    of blocks changed. ``gdn_qkv`` / ``gdn_norm_out`` apply to the mixers the model family names
    (``ModelFamily.recompute_mixers``): those of ``model_name``'s family, else of every registered one."""
    reason = check_modules(list(modules))
    if reason:
        raise ValueError(reason)
    _cpu_rng_shim()
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from models import MODEL_REGISTRY, get_model_family

    families = [get_model_family(model_name)] if model_name else list(MODEL_REGISTRY.values())
    split_mixers = tuple(cls for family in families for cls in family.recompute_mixers())

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
        norm = "layernorm" in modules
        is_gdn = isinstance(mixer, split_mixers)
        qkv, norm_out = is_gdn and "gdn_qkv" in modules, is_gdn and "gdn_norm_out" in modules
        if norm or qkv or norm_out:
            _LayerRecompute(layer, norm, qkv, norm_out)
            changed += 2 * norm + qkv + norm_out
    return changed


def _cpu_rng_shim() -> None:
    """megatron's checkpoint (core_attn, shared_experts) saves and restores the CUDA RNG state;
    without a GPU there is none and torch.cuda.get_rng_state would fail. The CPU generator and
    the (CPU) RNG tracker are still saved and restored by megatron as usual."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: None
    mcore_random._set_cuda_rng_state = lambda *a, **k: None


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


class _LayerRecompute:
    """The discard-output blocks of one TransformerLayer and the hooks that replay them."""

    def __init__(self, layer, norm: bool, qkv: bool, norm_out: bool):
        self.layer = layer
        self.attn_half: list[_DiscardCheckpoint] = []  # input norm, gdn_qkv, gdn_norm_out (forward order)
        self.mlp_half: list[_DiscardCheckpoint] = []  # pre-MLP norm
        self.deferring = False
        layer._recompute = self
        if norm:
            _wrap_forward(layer.input_layernorm, lambda f, x: self._checkpoint(self.attn_half, f, x))
            _wrap_forward(layer.pre_mlp_layernorm, lambda f, x: self._checkpoint(self.mlp_half, f, x))
            layer.mlp.register_forward_hook(self._after(self.mlp_half))
        gdn = layer.self_attention
        if qkv:
            self.in_proj = gdn.in_proj.forward
            self.prepare = gdn.prepare
            _wrap_forward(gdn, self._gdn_forward)
            _wrap_forward(gdn.in_proj, self._in_proj)
            gdn.prepare = self._prepare
        if norm_out:
            norm_out_fn = gdn.norm_out
            gdn.norm_out = lambda core, z: self._checkpoint(self.attn_half, norm_out_fn, core, z)
        gdn.register_forward_hook(self._after(self.attn_half))

    def _active(self) -> bool:
        return self.layer.training and torch.is_grad_enabled()

    def _checkpoint(self, blocks, fn, *args):
        if not self._active():
            return fn(*args)
        ckpt = _DiscardCheckpoint(fn, *args)
        blocks.append(ckpt)
        return ckpt.result

    def _gdn_forward(self, forward, hidden_states, *args, packed_seq_params=None, **kwargs):
        from models.common.packed_seq import cp_info

        # in_proj joins prepare's checkpoint, on the path that calls prepare (not under CP)
        self.deferring = self._active() and cp_info(packed_seq_params) is None
        try:
            return forward(hidden_states, *args, packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self.deferring = False

    def _in_proj(self, forward, x, *args, **kwargs):
        if self.deferring:
            return x, None  # prepare receives the norm output and projects inside its checkpoint
        return forward(x, *args, **kwargs)

    def _prepare(self, hidden, cu_seqlens, varlen=None):
        if not self.deferring:
            return self.prepare(hidden, cu_seqlens, varlen)
        return self._checkpoint(self.attn_half, lambda h: self.prepare(self.in_proj(h)[0], cu_seqlens, varlen), hidden)

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
