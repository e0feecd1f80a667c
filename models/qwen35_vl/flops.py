"""Qwen3.5-VL training FLOPs of a batch (``ModelFamily.training_flops``), counted from real tokens
only (padding is free work, not credit).

Forward FLOPs are 2 x multiply-accumulates of every matmul a real token takes part in;
training = 3 x forward (backward costs two forwards). Per component:
- full attention: projections, plus causal scores/values 4*H*d per (query, key) pair
  inside each sample: sum over samples of L(L+1)/2 pairs;
- Gated DeltaNet: projections, conv, and the chunked delta rule (per token and value
  head: state read and update 4*dk*dv, intra-chunk terms 2*C*(dk+dv), C = 64);
- MLP / MoE (top-k routed experts + shared expert + router), LM head (with
  ``model.sparse_lm_head``: at the loss tokens only, the tokens it ran on);
- vision encoder per patch (blocks + attention within each image) and the merger.
"""

from __future__ import annotations

from collections.abc import Iterable

CHUNK = 64


def decoder_flops_per_token(m) -> tuple[float, float]:
    """(forward FLOPs per token excluding attention scores, attention-score FLOPs per pair)."""
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
    gdn += nv * (4 * dk * dv + 2 * CHUNK * (dk + dv))
    if m.num_experts:
        mlp = m.moe_router_topk * 6 * h * m.moe_ffn_hidden_size + 2 * h * m.num_experts
        mlp += 6 * h * m.moe_shared_expert_intermediate_size + (2 * h if m.moe_shared_expert_intermediate_size else 0)
    else:
        mlp = 6 * h * m.ffn_hidden_size
    per_token = n_attn * attn_proj + n_gdn * gdn + m.num_layers * mlp + 2 * h * m.vocab_size
    per_pair = n_attn * 4 * q  # QK^T and PV per (query, key) pair
    return float(per_token), float(per_pair)


def vision_flops(m, image_grids: Iterable[tuple[int, int, int]]) -> float:
    v = m.vision
    h, f, merge2 = v.hidden_size, v.intermediate_size, v.spatial_merge_size**2
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    per_patch = 2 * patch_dim * h + v.depth * (2 * h * 3 * h + 2 * h * h + 4 * h * f)
    total = 0.0
    for t, gh, gw in image_grids:
        n = t * gh * gw
        total += n * per_patch
        total += v.depth * 4 * h * (gh * gw) ** 2 * t  # full (non-causal) attention per frame
        merged = n // merge2
        total += merged * (2 * (h * merge2) ** 2 + 2 * h * merge2 * m.hidden_size)
    return total


def training_flops(m, sample_lengths: Iterable[int], image_grids: Iterable[tuple[int, int, int]],
                   lm_head_tokens: int | None = None) -> float:
    """FLOPs of forward + backward for the given real samples. ``lm_head_tokens``: how many tokens
    the LM head ran on (``model.sparse_lm_head``: the loss tokens); None: every real token."""
    per_token, per_pair = decoder_flops_per_token(m)
    lengths = list(sample_lengths)
    fwd = per_token * sum(lengths) + per_pair * sum(L * (L + 1) / 2 for L in lengths)
    if lm_head_tokens is not None:  # the LM head skipped the tokens without loss
        fwd -= 2 * m.hidden_size * m.vocab_size * (sum(lengths) - lm_head_tokens)
    fwd += vision_flops(m, image_grids)
    return 3.0 * fwd
