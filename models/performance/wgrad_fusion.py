"""Weight-gradient accumulation fusion without Apex (``model.grad_accum_fusion``).

megatron-core's linear layers can add each weight gradient straight into the fp32
``main_grad`` buffer inside the backward GEMM (``gradient_accumulation_fusion``), but only
through Apex's ``fused_weight_gradient_mlp_cuda`` extension, which we do not ship. Without it
every linear's backward writes a bf16 weight gradient, and megatron's DDP hook then launches a
separate fp32 add into ``main_grad`` (one per linear: hundreds of adds and as many host
launches per step, docs/kernels.md).

torch's ``addmm`` with ``out_dtype=float32`` does the same GEMM as Apex's kernel: bf16 inputs,
fp32 accumulation, beta = 1 into the fp32 buffer. ``enable()`` hands megatron a stand-in
module with Apex's two entry points built on it. The result differs from the unfused path
only in that the weight gradient is not rounded to bf16 before it is added (more exact).

The vocabulary weights take the same road (``enable``): the word embedding's backward adds
its rows into ``main_grad`` with one ``index_add_`` (the unfused backward builds a dense
[vocab, hidden] bf16 gradient, 0.5G elements on the 2B, for the few thousand rows a batch
touches), and the fused LM head (fused_kernels/fused_linear_ce.py) adds its weight gradient there in
its GEMM. With tied weights both go into the one shared ``main_grad`` and autograd sees one
placeholder: nothing dense is summed, copied or added.

Eager, it measures slower; under CUDA graphs that add the other gradients into main_grad inside
the graph (``train.cuda_graphs.grads_to_main_grad``) it measures faster (step times in
docs/kernels.md). So ``null`` turns it on exactly there.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from core import compat
from fused_kernels.wgrad_accum import added_to_main_grad, wgrad_gemm_accum_fp16, wgrad_gemm_accum_fp32


@functools.cache
def unavailable_reason() -> str | None:
    """None if the fused path runs here, else why not. On CUDA it needs torch's
    ``addmm(out_dtype=...)``, checked once against the fp32 GEMM. The CPU (megatron patched by
    multimodal/platform.py) runs it with upcast inputs: correct, and used by the tests, but no
    faster, so ``null`` leaves it off there."""
    if not torch.cuda.is_available():
        return None
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(96, 48, device="cuda", generator=gen).to(torch.bfloat16)
        g = torch.randn(96, 32, device="cuda", generator=gen).to(torch.bfloat16)
        acc = torch.randn(32, 48, device="cuda", generator=gen)
        want = acc + g.float().t() @ x.float()
        wgrad_gemm_accum_fp32(x, g, acc)
        err = ((acc - want).abs().max() / want.abs().max()).item()
    except (RuntimeError, TypeError) as e:  # an older torch without addmm's out_dtype
        return f"torch {torch.__version__} cannot run addmm(out_dtype=float32) ({e})"
    if err > 1e-5:
        return f"addmm(out_dtype=float32) disagrees with the fp32 GEMM (max rel err {err:.1e})"
    return None


def resolve(requested: bool | None, graphs_add_to_main_grad: bool = False) -> bool:
    """model.grad_accum_fusion: null -> on where it measured faster (CUDA graphs that add the other
    gradients into main_grad, see the module doc), else off; true -> on, or a clear error."""
    reason = unavailable_reason()
    if requested is None:
        return graphs_add_to_main_grad and reason is None and torch.cuda.is_available()
    if requested and reason is not None:
        raise RuntimeError(f"model.grad_accum_fusion=true cannot run: {reason}; set it to null or false")
    return bool(requested)


def enable(model: torch.nn.Module) -> int:
    """Switch the fusion on in every megatron linear layer of ``model`` whose weight has a
    ``main_grad`` (set by megatron's DDP wrapper, which must come first: the fused backward
    writes there), and for the vocabulary weights (word embedding, fused LM head). Returns how
    many weights use it. Models built without DDP (conversion, parity scripts) keep the plain
    backward."""
    from megatron.core.tensor_parallel import layers

    compat.replace(compat.WGRAD_EXTENSION, types.SimpleNamespace(
        wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16))
    compat.replace(compat.WGRAD_AVAILABLE, True)
    fused = set()
    for module in model.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)) and hasattr(
                getattr(module, "weight", None), "main_grad"):
            module.gradient_accumulation_fusion = True
            fused.add(id(module.weight))
    return len(fused | _enable_vocabulary(model))


# ----------------------------------------------------------------------------- vocabulary weights


class _EmbeddingToMainGrad(torch.autograd.Function):
    """F.embedding whose backward adds the looked-up rows' gradients into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        main_grad = weight.main_grad
        # atomics on CUDA, like F.embedding's own backward: not bit-deterministic, so the
        # deterministic mode (train.deterministic) keeps megatron's path (see _eligible)
        main_grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype))
        return None, added_to_main_grad(weight)


def _embedding_forward(module, input_):
    """megatron's VocabParallelEmbedding.forward (no sequence-parallel scatter), lookup fused."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = module.tp_group.size()
    ids = input_
    if tp > 1:  # ids outside this rank's vocabulary shard look up row 0 and are zeroed after
        outside = (input_ < module.vocab_start_index) | (input_ >= module.vocab_end_index)
        ids = (input_ - module.vocab_start_index).masked_fill(outside, 0)
    out = _EmbeddingToMainGrad.apply(ids, module.weight)
    if tp > 1:
        out = out.masked_fill(outside[..., None], 0.0)
        out = reduce_from_tensor_model_parallel_region(out, group=module.tp_group)
    return out


def _eligible(embedding) -> bool:
    return (hasattr(embedding.weight, "main_grad") and not embedding.deterministic_mode
            and not embedding.reduce_scatter_embeddings and getattr(embedding, "gtp_remat_size", 1) <= 1)


def _enable_vocabulary(model: torch.nn.Module) -> set[int]:
    """Word embeddings and fused LM heads of ``model``'s language models; returns their weights' ids."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    fused = set()
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and _eligible(module):
            module.forward = functools.partial(_embedding_forward, module)
            fused.add(id(module.weight))
    for lm in model.modules():
        if not getattr(lm, "post_process", False) or not hasattr(lm, "lm_head_weight"):
            continue
        tied = lm.share_embeddings_and_output_weights
        weight = lm.lm_head_weight()
        if not hasattr(weight, "main_grad"):
            continue
        # Tied and this rank's embedding fused: that backward (the last one) returns the one
        # placeholder, so the head returns None and autograd sums nothing. Otherwise the head
        # returns the placeholder itself (zeros while megatron's tied-weight mark stays, beside
        # an unfused lookup's dense gradient: see added_to_main_grad).
        lm.lm_head_grad = "main_grad_only" if id(weight) in fused else "main_grad"
        if id(weight) in fused or not tied:
            # every user of the weight here adds into main_grad: megatron's tied-weight mark (the
            # hook adds param.grad regardless, placeholders being zeros) would add garbage
            weight.zero_out_wgrad = False
        if tied:  # megatron's own output layer (no labels, or model.fused_linear_ce=false) too
            lm.output_layer.gradient_accumulation_fusion = True
        fused.add(id(weight))
    return fused
