"""The GPU side of multimodal/warm_kernels.py: each runner builds synthetic tensors of one rank's
shapes, in the layouts the layers hand over, and calls the kernel entry point the model calls,
forward and backward (gradients of the outputs' own shapes). Runs in spawned worker processes.

The call sites they mirror (keep them in step):
- ``pre_gdr``: Qwen35GatedDeltaNet._prepare_fused (fused_pre_gdr_from_proj on the transpose of
  in_proj's [S, B, D] output) and, under context parallelism, _context_parallel_core + prepare_heads
  (fused_pre_gdr on the head group's columns of the all-to-all output, with A_log / dt_bias slices);
- ``conv1d``: prepare_heads' unfused path (gated_delta_rule.causal_conv1d_silu, fla's kernel);
- ``flash_qla`` / ``fla``: gated_delta_rule.chunk_gated_delta_rule's two backends, with the plan
  (flash_qla_gdr) or the varlen table (GDNVarlen) a packed row gets;
- ``mrope_attention``: MRopeSelfAttention._rotate_from_positions (fused_mrope_pair, sbhd);
- ``vision_rotary``: VisionBlock.forward (fused_mrope.rotary_qkv on the qkv projection's view).
"""

from __future__ import annotations

import logging
import time
from itertools import accumulate

import torch
import torch.nn.functional as F

from core.errors import one_line

DEVICE = "cuda"  # set by run_jobs


def run_jobs(calls: list[tuple[str, dict]], device: int | str) -> list[tuple[float, float, str | None]]:
    """(start, end, error or None) of each (runner name, keyword arguments), in order, on GPU
    ``device`` (``"cpu"``: the tests, under the Triton interpreter)."""
    global DEVICE
    logging.basicConfig(level=logging.WARNING)
    DEVICE = "cpu" if device == "cpu" else f"cuda:{device}"
    if DEVICE != "cpu":
        torch.cuda.set_device(device)
    out = []
    for runner, kwargs in calls:
        start = time.time()
        try:
            RUNNERS[runner](**kwargs)
            if DEVICE != "cpu":
                torch.cuda.synchronize()
            error = None
        except Exception as e:  # reported in the summary; the other jobs go on
            error = f"{type(e).__name__}: {one_line(e)}"
        out.append((start, time.time(), error))
    return out


def _leaf(*shape, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE, dtype=dtype) * scale).requires_grad_()


def _backward(*outputs: torch.Tensor) -> None:
    """Backward from gradients shaped like the outputs (contiguous, as the next layer's would be)."""
    outs = [o for o in outputs if o is not None and o.requires_grad]
    torch.autograd.backward(outs, [torch.randn(o.shape, device=o.device, dtype=o.dtype) for o in outs])


def _cu(segments, dtype=torch.int32, device=None) -> torch.Tensor:
    """cu_seqlens of a row of these sample lengths (int32 on the device, as the loader's)."""
    return torch.tensor([0, *accumulate(segments)], dtype=dtype, device=device or DEVICE)


def _delta_rule_inputs(batch: int, seq: int, heads: int, key_dim: int, value_dim: int, dtype):
    """q, k (l2-normed), v, g (log decay, fp32) and beta: what prepare() hands the delta rule."""
    q = F.normalize(torch.randn(batch, seq, heads, key_dim, device=DEVICE), dim=-1).to(dtype).requires_grad_()
    k = F.normalize(torch.randn(batch, seq, heads, key_dim, device=DEVICE), dim=-1).to(dtype).requires_grad_()
    v = _leaf(batch, seq, heads, value_dim, dtype=dtype)
    g = F.logsigmoid(torch.randn(batch, seq, heads, device=DEVICE)).requires_grad_()  # fp32, as the model's
    beta = torch.rand(batch, seq, heads, device=DEVICE).to(dtype).requires_grad_()
    return q, k, v, g, beta


def flash_qla(heads, key_dim, value_dim, dtype, seq, batch, segments, max_chunks) -> None:
    """FlashQLA's delta rule on a packed row (``segments``; cut into pieces of ``max_chunks`` chunks
    when given, the plan FlashQLA's cost model would otherwise choose) or on dense rows."""
    import tilelang  # noqa: F401 - its import sets its logger to INFO: two lines per kernel compiled

    from fused_kernels import flash_qla_gdr as qla

    logging.getLogger("tilelang").setLevel(logging.WARNING)
    q, k, v, g, beta = _delta_rule_inputs(1 if segments else batch, seq, heads, key_dim, value_dim,
                                          getattr(torch, dtype))
    plan = None
    if segments is not None:
        # plan_from_host's steps with the split fixed here: int64 cu_seqlens (GDNVarlen's) with its
        # chunk tables attached, then FlashQLA's context (unsplit, or cut into pieces)
        cu = [0, *accumulate(segments)]
        cu_dev = torch.tensor(cu, dtype=torch.int64, device=DEVICE)
        qla._attach_table(cu_dev, cu)
        plan = qla.QLAPlan(qla._context(cu_dev, cu, max_chunks))
    _backward(qla.chunk_gated_delta_rule(q, k, v, g, beta, plan))


def fla(heads, key_dim, value_dim, dtype, seq, batch, segments, save_states) -> None:
    """fla's delta rule through the model's dispatcher, with the varlen table forward_step builds."""
    from fused_kernels import gated_delta_rule as gdr

    q, k, v, g, beta = _delta_rule_inputs(1 if segments else batch, seq, heads, key_dim, value_dim,
                                          getattr(torch, dtype))
    cu, varlen = None, None
    if segments is not None:
        cu = _cu(segments)
        varlen = gdr.GDNVarlen.from_host(_cu(segments, device="cpu"), torch.device(DEVICE))
    _backward(gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu, "fla", varlen, save_states))


def conv1d(channels, width, dtype, seq, batch, rows) -> None:
    """fla's causal conv1d + SiLU as prepare_heads' unfused path calls it: the concatenated q|k|v
    [B, S, C] (contiguous) and the conv weight [C, W]."""
    from fused_kernels import gated_delta_rule as gdr

    dt = getattr(torch, dtype)
    for segments in rows:
        x = _leaf(1 if segments else batch, seq, channels, dtype=dt)
        weight = _leaf(channels, width, dtype=dt, scale=0.5)
        cu, varlen = None, None
        if segments is not None:
            cu = _cu(segments)
            varlen = gdr.GDNVarlen.from_host(_cu(segments, device="cpu"), torch.device(DEVICE))
        _backward(gdr.causal_conv1d_silu(x, weight, cu, "fla", varlen))


def pre_gdr(tp_key_heads, tp_value_heads, key_dim, value_dim, conv_width, dtype, seq, batch, cp, cp_ranks,
            rows) -> None:
    """The fused pre-GDR kernels, forward and backward, for each row (one per cu_seqlens search
    depth; None: padded rows) and, under context parallelism, each alignment class of CP rank."""
    from fused_kernels import fused_pre_gdr

    dt = getattr(torch, dtype)
    nk, nv, K, V = tp_key_heads, tp_value_heads, key_dim, value_dim
    channels = 2 * nk * K + nv * V
    # the layer's parameters: conv1d.weight [C, 1, W], A_log and dt_bias [nv], in the run's dtype
    weight = _leaf(channels, 1, conv_width, dtype=dt, scale=0.5)
    A_log, dt_bias = _leaf(nv, dtype=dt), _leaf(nv, dtype=dt)
    for segments in rows:
        b = 1 if segments else batch
        cu = None if segments is None else _cu(segments)
        if cp == 1:
            proj = _leaf(seq, b, channels + nv * V + 2 * nv, dtype=dt)  # in_proj's output [S, B, qkv|z|b|a]
            _backward(*fused_pre_gdr.fused_pre_gdr_from_proj(proj.transpose(0, 1), weight.squeeze(1), A_log,
                                                              dt_bias, cu, nk, K, V, nv))
            continue
        # _context_parallel_core: the head groups' columns of the all-to-all output [S, B, W]
        gk, gv = nk // cp, nv // cp
        widths = [gk * K, gk * K, gv * V, gv, gv]
        full = _leaf(seq, b, sum(widths), dtype=dt)
        qg, kg, vg, bg, ag = (t.transpose(0, 1) for t in torch.split(full, widths, dim=-1))
        qkv = torch.cat([qg, kg, vg], dim=-1)
        w = weight.squeeze(1)
        w_q, w_k, w_v = torch.split(w, [nk * K, nk * K, nv * V])
        for r in cp_ranks:
            conv_weight = torch.cat([t.reshape(cp, -1, t.shape[-1])[r] for t in (w_q, w_k, w_v)])
            heads = slice(r * gv, (r + 1) * gv)
            _backward(*fused_pre_gdr.fused_pre_gdr(qkv, bg, ag, conv_weight, A_log[heads], dt_bias[heads], cu, gk,
                                                   K, V))


def mrope_attention(tokens, batch, heads, kv_heads, head_dim, rot_dim, theta, section, interleaved, dtype) -> None:
    """The decoder's q and k [S, B, H, D] rotated from position ids [3, B, S] in one autograd node."""
    from fused_kernels import fused_mrope
    from fused_kernels.rotary import inverse_frequencies

    dt = getattr(torch, dtype)
    q, k = _leaf(tokens, batch, heads, head_dim, dtype=dt), _leaf(tokens, batch, kv_heads, head_dim, dtype=dt)
    pos = torch.randint(0, tokens, (3, batch, tokens), device=DEVICE)
    inv = inverse_frequencies(rot_dim, theta).to(DEVICE)
    _backward(*fused_mrope.fused_mrope_pair(q, k, pos, inv, section, interleaved, "sbhd"))


def vision_rotary(patches, heads, head_dim, theta, dtype) -> None:
    """The vision blocks' q and k rotated out of the qkv projection [N, 3, H, D] (a view of the
    Linear's [N, 3*hidden] output), position ids [3, N] = (row, row, col)."""
    from fused_kernels import fused_mrope

    dt = getattr(torch, dtype)
    proj = _leaf(patches, 3 * heads * head_dim, dtype=dt)
    qkv = proj.view(patches, 3, heads, head_dim)
    quarter = head_dim // 2  # VisionEncoder.inv_freq
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
    n = inv_freq.numel()
    rows, cols = torch.randint(0, 64, (patches, 2), device=DEVICE).unbind(1)
    pos = torch.stack([rows, rows, cols])
    _backward(*fused_mrope.rotary_qkv(qkv, pos, torch.cat([inv_freq, inv_freq]).to(DEVICE), (0, n, n), False))


RUNNERS = {f.__name__: f for f in (flash_qla, fla, conv1d, pre_gdr, mrope_attention, vision_rotary)}
