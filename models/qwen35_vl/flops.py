"""Qwen3.5-VL training FLOPs of a batch (``ModelFamily.training_flops``), counted from real tokens
only (padding is free work, not credit).

Forward FLOPs are 2 x multiply-accumulates of every matmul a real token takes part in;
training = 3 x forward (backward costs two forwards), less for frozen parts
(models/common/training_passes.py). Per component:
- full attention: projections, plus causal scores/values 4*H*d per (query, key) pair
  inside each sample: sum over samples of L(L+1)/2 pairs;
- Gated DeltaNet: projections, conv, and the chunked delta rule (per token and value
  head: state read and update 4*dk*dv, intra-chunk terms 2*C*(dk+dv), C = 64);
- MLP / MoE (top-k routed experts + shared expert + router), LM head (with
  ``model.sparse_lm_head``: at the loss tokens only, the tokens it ran on);
- vision encoder per patch (blocks + attention within each image) and the merger;
- each MTP depth (``model.mtp_num_layers``): its eh_proj [H, 2H], one full-attention layer with
  the decoder's MLP / MoE, and its own pass through the LM head at every real token.
"""

from __future__ import annotations

from collections.abc import Iterable

from models.common.training_passes import TrainingPasses

CHUNK = 64


def decoder_flops_per_token(m) -> tuple[float, float]:
    """(forward FLOPs per token excluding attention scores, attention-score FLOPs per pair)."""
    weights, core, head, per_pair = _decoder_parts(m)
    return float(weights + core + head), float(per_pair)


def _decoder_parts(m) -> tuple[float, float, float, float]:
    """Forward FLOPs per token of the decoder's weights, of its weight-free products (the delta
    rule), of the LM head; and the attention-score FLOPs per (query, key) pair."""
    h = m.hidden_size
    n_attn = sum(1 for i in range(m.num_layers) if m.is_full_attention(i))
    n_gdn = m.num_layers - n_attn
    q = m.num_attention_heads * m.head_dim
    kv = m.num_query_groups * m.head_dim
    attn_proj = 2 * h * (2 * q + 2 * kv) + 2 * q * h
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    qk, v = m.linear_num_key_heads * dk, m.linear_num_value_heads * dv
    nv = m.linear_num_value_heads
    gdn = 2 * h * (2 * qk + 2 * v + 2 * nv) + 2 * v * h
    gdn += 2 * m.linear_conv_kernel_dim * (2 * qk + v)
    gdn_core = nv * (4 * dk * dv + 2 * CHUNK * (dk + dv))
    if m.num_experts:
        mlp = m.moe_router_topk * 6 * h * m.moe_ffn_hidden_size + 2 * h * m.num_experts
        mlp += 6 * h * m.moe_shared_expert_intermediate_size + (2 * h if m.moe_shared_expert_intermediate_size else 0)
    else:
        mlp = 6 * h * m.ffn_hidden_size
    weights = n_attn * attn_proj + n_gdn * gdn + m.num_layers * mlp
    return float(weights), float(n_gdn * gdn_core), float(2 * h * m.vocab_size), float(n_attn * 4 * q)


def _mtp_parts(m) -> tuple[float, float, float]:
    """Forward FLOPs per token of one MTP depth's weights (eh_proj + a full-attention layer) and of
    its LM-head pass; its attention-score FLOPs per pair."""
    h = m.hidden_size
    q = m.num_attention_heads * m.head_dim
    kv = m.num_query_groups * m.head_dim
    if m.num_experts:
        mlp = m.moe_router_topk * 6 * h * m.moe_ffn_hidden_size + 2 * h * m.num_experts
        mlp += 6 * h * m.moe_shared_expert_intermediate_size + (2 * h if m.moe_shared_expert_intermediate_size else 0)
    else:
        mlp = 6 * h * m.ffn_hidden_size
    weights = 2 * (2 * h) * h + 2 * h * (2 * q + 2 * kv) + 2 * q * h + mlp
    return float(weights), float(2 * h * m.vocab_size), float(4 * q)


def _mtp_flops(m, passes: TrainingPasses, tokens: int, pairs: float, head_tokens: int | None = None) -> float:
    """Training FLOPs of the MTP depths. Its weights train unless ``model.freeze`` has ``mtp`` or
    LoRA freezes every base weight; the backward passes through it when it or anything below trains.
    ``head_tokens``: the tokens the shared LM head ran on over all depths (``model.sparse_lm_head``:
    their loss tokens); None: every token at every depth."""
    depth = getattr(m, "mtp_num_layers", 0)
    if not depth:
        return 0.0
    trains = not m.lora.rank and "mtp" not in m.freeze
    through = trains or passes.decoder_core > 1
    head_trains = not m.lora.rank and "lm_head" not in m.freeze and not (
        m.tie_word_embeddings and "embedding" in m.freeze)
    weights, head, per_pair = _mtp_parts(m)
    head_tokens = depth * tokens if head_tokens is None else head_tokens
    return (depth * ((1 + through + trains) * weights * tokens + (1 + 2 * through) * per_pair * pairs)
            + (1 + through + head_trains) * head * head_tokens)


def vision_flops(m, image_grids: Iterable[tuple[int, int, int]]) -> float:
    return sum(_vision_parts(m, image_grids))


def _vision_parts(m, image_grids: Iterable[tuple[int, int, int]]) -> tuple[float, float]:
    """Forward FLOPs of the encoder (patch embedding, blocks, attention within each frame) and of
    the merger."""
    v = m.vision
    h, f, merge2 = v.hidden_size, v.intermediate_size, v.spatial_merge_size**2
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    per_patch = 2 * patch_dim * h + v.depth * (2 * h * 3 * h + 2 * h * h + 4 * h * f)
    encoder = merger = 0.0
    for t, gh, gw in image_grids:
        n = t * gh * gw
        encoder += n * per_patch
        encoder += v.depth * 4 * h * (gh * gw) ** 2 * t  # full (non-causal) attention per frame
        merger += n // merge2 * (2 * (h * merge2) ** 2 + 2 * h * merge2 * m.hidden_size)
    return encoder, merger


def training_flops(m, sample_lengths: Iterable[int], image_grids: Iterable[tuple[int, int, int]],
                   lm_head_tokens: int | None = None, mtp_head_tokens: int | None = None) -> float:
    """FLOPs of forward + backward for the given real samples. ``lm_head_tokens``: how many tokens
    the LM head ran on (``model.sparse_lm_head``: the loss tokens); None: every real token; the same
    for the MTP depths' passes through it, all depths together (``mtp_head_tokens``). Frozen
    parts (``model.freeze``, LoRA's base weights) count the passes they run (TrainingPasses)."""
    passes = TrainingPasses.of(m)
    weights, core, head, per_pair = _decoder_parts(m)
    lengths = list(sample_lengths)
    tokens = sum(lengths)
    pairs = sum(L * (L + 1) / 2 for L in lengths)
    head_tokens = tokens if lm_head_tokens is None else lm_head_tokens
    encoder, merger = _vision_parts(m, image_grids)
    return (passes.decoder_weights * weights * tokens + passes.decoder_core * (core * tokens + per_pair * pairs)
            + passes.lm_head * head * head_tokens + passes.vision * encoder + passes.merger * merger
            + _mtp_flops(m, passes, tokens, pairs, mtp_head_tokens))
