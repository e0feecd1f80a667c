"""Fused pre-gated-delta-rule chain: in_proj output -> (q, k, v, g, beta), one Triton kernel each way.

Unfused (``Qwen35GatedDeltaNet.prepare``): causal depthwise conv1d, SiLU, split, two l2
norms, repeat_interleave of key heads, contiguous copies, sigmoid, softplus, exp: each a
pass over memory, and autograd keeps most intermediates. Here:

- forward: one program per (block of tokens, head); the head is a q, k or v channel
  group of the conv. It reads its channels at t-3..t (the halo comes from cache), applies
  conv + SiLU in fp32, l2-normalises q/k heads, writes them to every value head they
  serve, and (v programs) writes g and beta for that head.
- backward, two kernels: (1) per (token block, head) it recomputes the conv output and SiLU
  from x (and the l2 norm for q/k), sums the repeated heads' gradients, and writes du, the
  gradient at the conv output, in the input dtype; the same program accumulates the weight,
  A_log and dt_bias gradients as fp32 partial sums (reduced by torch: deterministic) and writes
  db, da. (2) a 4-tap fold, dx[t] = sum_j w[3-j] du[t+j]. Saved tensors: the inputs only
  (views of the in_proj output, which is alive anyway). A one-pass backward that rebuilt du
  at t..t+3 in registers measured slower: its per-token-block reductions,
  not memory, bound it (docs/kernels.md).

Whole-projection entry (``fused_pre_gdr_from_proj``, what the model uses): the Function takes
in_proj's whole output [B, S, qkv | z | b | a] and returns z as a view of it. Its backward
allocates one gradient of that shape; the kernels write dqkv (the fold), db and da into their
columns through strides and dz is copied into its own. Splitting outside the Function instead
made autograd's split backward cat the four gradients into a fresh tensor, one more read and
write of dqkv, db, da per layer.

Packed rows (B == 1 with ``cu_seqlens``): the conv reads and the tap folding never cross a
sample boundary. A small kernel first tabulates every token's sample bounds from cu_seqlens on
the device (no host sync), once per call; the forward, backward and fold kernels read that table.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from fused_kernels.gated_delta_rule import causal_conv1d_silu_ref, l2norm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the reference still works
    triton = None

from fused_kernels.triton_support import autotuning, cu_steps, interpreting, unavailable_reason  # noqa: E402

EPS = 1e-6  # l2norm eps of the reference (inside the rsqrt)


# ----------------------------------------------------------------------------- reference


def pre_gdr_reference(qkv, b, a, weight, A_log, dt_bias, cu_seqlens, num_k_heads: int, head_k_dim: int,
                      head_v_dim: int):
    """The unfused path of Qwen35GatedDeltaNet.prepare (PyTorch backend), minus z.

    qkv [B, S, 2*nk*K + nv*V], b and a [B, S, nv], weight [C, W]. Returns q, k [B, S, nv, K],
    v [B, S, nv, V], g fp32 [B, S, nv], beta [B, S, nv].
    """
    batch, seq = qkv.shape[:2]
    qk = num_k_heads * head_k_dim
    nv = b.shape[-1]
    qkv = causal_conv1d_silu_ref(qkv, weight, cu_seqlens)
    q, k, v = torch.split(qkv, [qk, qk, qkv.shape[-1] - 2 * qk], dim=-1)
    q = l2norm(q.reshape(batch, seq, -1, head_k_dim))
    k = l2norm(k.reshape(batch, seq, -1, head_k_dim))
    v = v.reshape(batch, seq, nv, head_v_dim)
    if nv != num_k_heads:
        q, k = q.repeat_interleave(nv // num_k_heads, dim=2), k.repeat_interleave(nv // num_k_heads, dim=2)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q.contiguous(), k.contiguous(), v.contiguous(), g, beta


# ----------------------------------------------------------------------------- checks


def available(qkv: torch.Tensor, weight: torch.Tensor, num_k_heads: int, num_v_heads: int) -> str | None:
    """None when the fused kernels can run on these inputs, else the reason (for the fallback warning)."""
    reason = unavailable_reason(qkv)
    if reason is not None:
        return reason
    if weight.shape[-1] != 4:
        return f"conv kernel size {weight.shape[-1]} (the kernel is written for 4)"
    if num_v_heads % num_k_heads:
        return f"value heads {num_v_heads} not a multiple of key heads {num_k_heads}"
    return None


# ----------------------------------------------------------------------------- kernels

if triton is not None:
    # do_not_specialize below: the number of packed samples (n_cu) and, for other recipes, the
    # row length change from batch to batch; Triton would otherwise compile a new variant (and
    # re-run the autotuner) whenever one of them becomes 1 or a multiple of 16 mid-training.

    def _configs(*choices):
        """(BLOCK_T, num_warps) pairs; the first is the only one when autotuning is off. Chosen from
        the H200 launch-config sweep (docs/kernels.md, Fused Triton kernels; raw results in
        docs/benchmarks/2026-12-01/kernels_pre_gdr_launch_configs_2b_9b_8k_h200_2026-12-01.json):
        small token blocks with few warps won for every kernel, and the backward's per-program dw partials
        (4 x BLOCK_T x BLOCK_C fp32) spill registers beyond BLOCK_T 16. That sweep ran while each
        program still searched cu_seqlens itself (latency-bound); larger blocks are candidates
        again since the bounds come from a table."""
        if interpreting():  # several configs cannot be benchmarked without a GPU; big blocks = fewer
            return [triton.Config({"BLOCK_T": 32}, num_warps=4)]  # interpreted ops (the slow part)
        configs = [triton.Config({"BLOCK_T": bt}, num_warps=nw) for bt, nw in choices]
        return configs if autotuning() else configs[:1]

    @triton.jit
    def _sample_bounds(cu_ptr, n_cu, s, S, CU_STEPS: tl.constexpr):
        """[start, end) of the sample holding each token s of a packed row.

        A binary search per token for the last offset <= s: CU_STEPS = log2 of the bucketed offset
        count loads per token. (Comparing every token with every offset costs as much as the
        kernels' own work once CUDA graphs pad cu_seqlens to a few dozen offsets.)"""
        lo = tl.zeros_like(s)  # cu[lo] <= s holds throughout (cu[0] = 0)
        hi = tl.zeros_like(s) + (n_cu - 1)
        for _ in tl.static_range(CU_STEPS):
            mid = (lo + hi + 1) // 2
            go = tl.load(cu_ptr + mid).to(tl.int64) <= s
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        start = tl.load(cu_ptr + lo).to(tl.int64)
        end = tl.load(cu_ptr + lo + 1, mask=lo + 1 < n_cu, other=S).to(tl.int64)
        return start, end

    @triton.jit(do_not_specialize=["S", "n_cu"])
    def _token_bounds(cu_ptr, bnd_ptr, S, n_cu, CU_STEPS: tl.constexpr, BLOCK: tl.constexpr):
        """bnd[0, s] / bnd[1, s] = start / end of token s's sample, once per layer call: the main
        kernels then load them (one coalesced load per token) instead of each (token block, head)
        program repeating a CU_STEPS-long chain of dependent loads, which bound them by latency."""
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = s < S
        start, end = _sample_bounds(cu_ptr, n_cu, s, S, CU_STEPS)
        tl.store(bnd_ptr + s, start.to(tl.int32), mask=m)
        tl.store(bnd_ptr + S + s, end.to(tl.int32), mask=m)

    @triton.jit
    def _bounds_of(bnd_ptr, s, S, VARLEN: tl.constexpr):
        """[start, end) of each token's sample from the ``_token_bounds`` table (whole row without one)."""
        if VARLEN:
            m = s < S
            start = tl.load(bnd_ptr + s, mask=m, other=0).to(tl.int64)
            end = tl.load(bnd_ptr + S + s, mask=m, other=0).to(tl.int64)
        else:
            start = tl.zeros_like(s)
            end = tl.zeros_like(s) + S
        return start, end

    @triton.jit
    def _softplus(x):
        # torch's softplus (threshold 20) with an accurate log1p for small exp(-|x|)
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))
        return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)

    @triton.autotune(configs=_configs((16, 2), (8, 1), (32, 4), (16, 4), (64, 4)),
                     key=["C", "NK", "NV", "K", "V", "VARLEN"])
    @triton.jit(do_not_specialize=["S", "sxb", "sbb", "sab"])
    def _pre_gdr_fwd(
        x_ptr, w_ptr, b_ptr, a_ptr, alog_ptr, dt_ptr, bnd_ptr,
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
        S, sxb, sxs, sbb, sbs, sab, sas,
        C: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        pid_t, head, bi = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        s = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        smask = s < S
        start, end = _bounds_of(bnd_ptr, s, S, VARLEN)
        is_v = head >= 2 * NK
        c0 = tl.where(is_v, 2 * NK * K + (head - 2 * NK) * V, head * K)
        width = tl.where(is_v, V, K)
        cc = tl.arange(0, BLOCK_C)
        cmask = cc < width
        c = c0 + cc
        xrow = x_ptr + bi * sxb + s[:, None] * sxs + c[None, :]
        u = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for i in tl.static_range(4):  # out[t] = sum_i w[3-i] x[t-i] within the sample
            w = tl.load(w_ptr + c * 4 + (3 - i), mask=cmask, other=0.0).to(tl.float32)
            m = (smask & (s - i >= start))[:, None] & cmask[None, :]
            u += w[None, :] * tl.load(xrow - i * sxs, mask=m, other=0.0).to(tl.float32)
        y = u * tl.sigmoid(u)
        om = smask[:, None] & cmask[None, :]
        tok = (bi * S + s)[:, None]
        if is_v:
            hv = head - 2 * NK
            tl.store(v_ptr + (tok * NV + hv) * V + cc[None, :], y.to(v_ptr.dtype.element_ty), mask=om)
            bv = tl.load(b_ptr + bi * sbb + s * sbs + hv, mask=smask, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + bi * sab + s * sas + hv, mask=smask, other=0.0).to(tl.float32)
            alog = tl.load(alog_ptr + hv).to(tl.float32)
            dt = tl.load(dt_ptr + hv).to(tl.float32)
            g = -tl.exp(alog) * _softplus(av + dt)
            tl.store(g_ptr + (bi * S + s) * NV + hv, g, mask=smask)
            tl.store(beta_ptr + (bi * S + s) * NV + hv, tl.sigmoid(bv).to(beta_ptr.dtype.element_ty), mask=smask)
        else:
            r = tl.rsqrt(tl.sum(y * y, axis=1) + 1e-6)
            y = y * r[:, None]
            out_ptr = q_ptr
            hk = head
            if head >= NK:
                out_ptr = k_ptr
                hk = head - NK
            REP: tl.constexpr = NV // NK
            for j in tl.static_range(REP):  # the key head serves REP value heads
                tl.store(out_ptr + (tok * NV + hk * REP + j) * K + cc[None, :],
                         y.to(out_ptr.dtype.element_ty), mask=om)


    @triton.jit
    def _du_head(
        x_ptr, w_ptr, bnd_ptr, dy_ptr, du_ptr, dw_part, bi, pid_t, n_pt, S, sxb, sxs,
        c0, hout, C: tl.constexpr, NV: tl.constexpr, WIDTH: tl.constexpr, REP: tl.constexpr,
        NORM: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr,
        BLOCK_T: tl.constexpr, ITERS: tl.constexpr,
    ):
        """du (gradient at the conv output, before SiLU) and partial dw for one q, k or v head."""
        cc = tl.arange(0, BLOCK_C)
        cmask = cc < WIDTH
        c = c0 + cc
        w0 = tl.load(w_ptr + c * 4 + 3, mask=cmask, other=0.0).to(tl.float32)  # tap on x[t]
        w1 = tl.load(w_ptr + c * 4 + 2, mask=cmask, other=0.0).to(tl.float32)  # tap on x[t-1]
        w2 = tl.load(w_ptr + c * 4 + 1, mask=cmask, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + c * 4 + 0, mask=cmask, other=0.0).to(tl.float32)
        # dw accumulates elementwise over the token blocks; one reduction at the end
        a0 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        a3 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for it in range(ITERS):
            s = (pid_t * ITERS + it) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
            smask = s < S
            start, end = _bounds_of(bnd_ptr, s, S, VARLEN)
            xrow = x_ptr + bi * sxb + s[:, None] * sxs + c[None, :]
            m = smask[:, None] & cmask[None, :]
            x0 = tl.load(xrow, mask=m, other=0.0).to(tl.float32)
            x1 = tl.load(xrow - sxs, mask=m & (s - 1 >= start)[:, None], other=0.0).to(tl.float32)
            x2 = tl.load(xrow - 2 * sxs, mask=m & (s - 2 >= start)[:, None], other=0.0).to(tl.float32)
            x3 = tl.load(xrow - 3 * sxs, mask=m & (s - 3 >= start)[:, None], other=0.0).to(tl.float32)
            u = w0[None, :] * x0 + w1[None, :] * x1 + w2[None, :] * x2 + w3[None, :] * x3
            sig = tl.sigmoid(u)
            gy = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for r in tl.static_range(REP):  # the repeated heads' gradients add up
                gy += tl.load(dy_ptr + ((bi * S + s[:, None]) * NV + hout + r) * WIDTH + cc[None, :],
                              mask=m, other=0.0).to(tl.float32)
            if NORM:  # n = y * rsqrt(|y|^2 + eps): dy = rstd * (gn - n * <n, gn>)
                y = u * sig
                rstd = tl.rsqrt(tl.sum(y * y, axis=1) + 1e-6)
                n = y * rstd[:, None]
                gy = rstd[:, None] * (gy - n * tl.sum(n * gy, axis=1)[:, None])
            du = tl.where(m, gy * sig * (1.0 + u * (1.0 - sig)), 0.0)
            tl.store(du_ptr + (bi * S + s[:, None]) * C + c[None, :], du.to(du_ptr.dtype.element_ty), mask=m)
            a0 += du * x0
            a1 += du * x1
            a2 += du * x2
            a3 += du * x3
        prow = dw_part + (bi * n_pt + pid_t) * C * 4 + c * 4
        tl.store(prow + 3, tl.sum(a0, axis=0), mask=cmask)
        tl.store(prow + 2, tl.sum(a1, axis=0), mask=cmask)
        tl.store(prow + 1, tl.sum(a2, axis=0), mask=cmask)
        tl.store(prow + 0, tl.sum(a3, axis=0), mask=cmask)

    @triton.autotune(configs=_configs((8, 2), (8, 4), (16, 4), (16, 2)),
                     key=["C", "NK", "NV", "K", "V", "VARLEN", "TPP"])
    @triton.jit(do_not_specialize=["S", "sxb", "sbb", "sab", "sdbb", "sdab"])
    def _pre_gdr_bwd(
        x_ptr, w_ptr, b_ptr, a_ptr, alog_ptr, dt_ptr, bnd_ptr,
        dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,
        du_ptr, db_ptr, da_ptr, dw_part, dalog_part, ddt_part,
        S, sxb, sxs, sbb, sbs, sab, sas, sdbb, sdbs, sdab, sdas,
        C: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, TPP: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        # phase 1 of the backward: du per head (q/k: l2-norm and SiLU backward, v: SiLU backward),
        # dw partials, and the gate gradients. Each program owns TPP tokens (fixed by the caller, so
        # the partial-sum buffers do not depend on the tuned BLOCK_T) of one head. db and da are
        # written through their own (batch, token) strides: columns of the whole in_proj gradient
        # (fused_pre_gdr_from_proj) or their own contiguous tensors.
        pid_t, head, bi = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        n_pt = tl.num_programs(0)
        REP: tl.constexpr = NV // NK
        ITERS: tl.constexpr = TPP // BLOCK_T
        if head < NK:
            _du_head(x_ptr, w_ptr, bnd_ptr, dq_ptr, du_ptr, dw_part, bi, pid_t, n_pt, S, sxb, sxs,
                     head * K, head * REP, C, NV, K, REP, True, VARLEN, BLOCK_C, BLOCK_T, ITERS)
        elif head < 2 * NK:
            _du_head(x_ptr, w_ptr, bnd_ptr, dk_ptr, du_ptr, dw_part, bi, pid_t, n_pt, S, sxb, sxs,
                     head * K, (head - NK) * REP, C, NV, K, REP, True, VARLEN, BLOCK_C, BLOCK_T, ITERS)
        else:
            hv = head - 2 * NK
            _du_head(x_ptr, w_ptr, bnd_ptr, dv_ptr, du_ptr, dw_part, bi, pid_t, n_pt, S, sxb, sxs,
                     2 * NK * K + hv * V, hv, C, NV, V, 1, False, VARLEN, BLOCK_C, BLOCK_T, ITERS)
            # gates of value head hv: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
            e_a = tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
            dt = tl.load(dt_ptr + hv).to(tl.float32)
            acc_alog = tl.zeros([BLOCK_T], dtype=tl.float32)
            acc_dt = tl.zeros([BLOCK_T], dtype=tl.float32)
            for it in range(ITERS):
                s = (pid_t * ITERS + it) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
                smask = s < S
                o = (bi * S + s) * NV + hv
                beta = tl.sigmoid(tl.load(b_ptr + bi * sbb + s * sbs + hv, mask=smask, other=0.0).to(tl.float32))
                dbeta = tl.load(dbeta_ptr + o, mask=smask, other=0.0).to(tl.float32)
                tl.store(db_ptr + bi * sdbb + s * sdbs + hv, (dbeta * beta * (1.0 - beta)).to(db_ptr.dtype.element_ty),
                         mask=smask)
                xa = tl.load(a_ptr + bi * sab + s * sas + hv, mask=smask, other=0.0).to(tl.float32) + dt
                dg = tl.load(dg_ptr + o, mask=smask, other=0.0)
                da = tl.where(smask, -dg * e_a * tl.sigmoid(xa), 0.0)
                tl.store(da_ptr + bi * sdab + s * sdas + hv, da.to(da_ptr.dtype.element_ty), mask=smask)
                acc_alog += tl.where(smask, -dg * e_a * _softplus(xa), 0.0)
                acc_dt += da
            tl.store(dalog_part + (bi * n_pt + pid_t) * NV + hv, tl.sum(acc_alog, axis=0))
            tl.store(ddt_part + (bi * n_pt + pid_t) * NV + hv, tl.sum(acc_dt, axis=0))


    @triton.jit(do_not_specialize=["S", "sdxb"])
    def _conv_fold(du_ptr, w_ptr, bnd_ptr, dx_ptr, S, sdxb, sdxs, C: tl.constexpr, VARLEN: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """Phase 2: dx[t] = sum_j w[3-j] du[t+j], taps inside t's sample only (the conv's transpose).
        dx is written through its (batch, token) strides, so it can be columns of a wider tensor."""
        bi = tl.program_id(2).to(tl.int64)
        s = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        smask, cmask = s < S, c < C
        _, end = _bounds_of(bnd_ptr, s, S, VARLEN)
        row = du_ptr + (bi * S + s[:, None]) * C + c[None, :]
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(4):
            w = tl.load(w_ptr + c * 4 + (3 - j), mask=cmask, other=0.0).to(tl.float32)
            m = (smask & (s + j < end))[:, None] & cmask[None, :]
            dx += w[None, :] * tl.load(row + j * C, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + bi * sdxb + s[:, None] * sdxs + c[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=smask[:, None] & cmask[None, :])


def _row_view(t: torch.Tensor) -> torch.Tensor:
    """Any [B, S, N] view with unit channel stride is read in place; others are copied once."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _sample_bounds_table(cu_seqlens, S: int, ref: torch.Tensor) -> torch.Tensor:
    """int32 [2, S]: each token's sample start and end (packed rows); a placeholder without
    cu_seqlens (the kernels then use the whole row and never read it)."""
    if cu_seqlens is None:
        return ref.new_empty(0, dtype=torch.int32)
    bounds = torch.empty(2, S, device=ref.device, dtype=torch.int32)
    if S:
        n_cu = cu_seqlens.numel()
        _token_bounds[(triton.cdiv(S, 1024),)](cu_seqlens, bounds, S, n_cu, CU_STEPS=cu_steps(n_cu), BLOCK=1024,
                                               num_warps=4)
    return bounds


def _forward(qkv, b, a, weight, A_log, dt_bias, cu_seqlens, nk, K, V):
    """The forward kernel on [B, S, N] views with unit channel stride: q, k, v, g, beta and the
    sample-bounds table the backward reuses."""
    B, S, C = qkv.shape
    nv = b.shape[-1]
    if cu_seqlens is not None and B != 1:
        raise ValueError("packed (cu_seqlens) input needs one row (B == 1)")
    dev = qkv.device
    q = torch.empty(B, S, nv, K, device=dev, dtype=qkv.dtype)
    k = torch.empty_like(q)
    v = torch.empty(B, S, nv, V, device=dev, dtype=qkv.dtype)
    g = torch.empty(B, S, nv, device=dev, dtype=torch.float32)
    beta = torch.empty(B, S, nv, device=dev, dtype=b.dtype)
    bounds = _sample_bounds_table(cu_seqlens, S, qkv)
    if B * S:
        grid = lambda meta: (triton.cdiv(S, meta["BLOCK_T"]), 2 * nk + nv, B)  # noqa: E731
        _pre_gdr_fwd[grid](
            qkv, weight, b, a, A_log, dt_bias, bounds, q, k, v, g, beta,
            S, qkv.stride(0), qkv.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
            C=C, NK=nk, NV=nv, K=K, V=V, VARLEN=cu_seqlens is not None,
            BLOCK_C=triton.next_power_of_2(max(K, V)),
        )
    return q, k, v, g, beta, bounds


def _backward(qkv, b, a, weight, A_log, dt_bias, bounds, varlen, nk, K, V, dq, dk, dv, dg, dbeta, dx, db, da):
    """Both backward kernels. Writes dx [B, S, C], db and da [B, S, nv] in place, each any view with
    unit channel stride (the kernels take their batch and token strides); returns dw, dA_log, ddt_bias."""
    B, S, C = qkv.shape
    nv = b.shape[-1]
    if B * S == 0:
        return torch.zeros_like(weight), torch.zeros_like(A_log), torch.zeros_like(dt_bias)
    dq, dk, dv, dbeta = (t.contiguous() for t in (dq, dk, dv, dbeta))
    dg = dg.float().contiguous()
    tpp = _tokens_per_program(S, B * (2 * nk + nv))
    n_pt = triton.cdiv(S, tpp)
    # partial sums per (row, token program): every entry is written once by its program
    dw_part = torch.empty(B * n_pt, C, 4, device=qkv.device, dtype=torch.float32)
    alog_part = torch.empty(B * n_pt, nv, device=qkv.device, dtype=torch.float32)
    dt_part = torch.empty(B * n_pt, nv, device=qkv.device, dtype=torch.float32)
    # phase 1: du (in the input dtype: the fold below is a 4-term sum) and all parameter partials
    du = torch.empty(B, S, C, device=qkv.device, dtype=qkv.dtype)
    _pre_gdr_bwd[(n_pt, 2 * nk + nv, B)](
        qkv, weight, b, a, A_log, dt_bias, bounds, dq, dk, dv, dg, dbeta, du, db, da, dw_part, alog_part, dt_part,
        S, qkv.stride(0), qkv.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        db.stride(0), db.stride(1), da.stride(0), da.stride(1),
        C=C, NK=nk, NV=nv, K=K, V=V, VARLEN=varlen,
        BLOCK_C=triton.next_power_of_2(max(K, V)), TPP=tpp,
    )
    # phase 2: fold the taps back onto the conv input
    bt = 32 if interpreting() else 16  # 16 x 128 with 2 warps: best of the H200 launch-config sweep (docs/kernels.md)
    _conv_fold[(triton.cdiv(S, bt), triton.cdiv(C, 128), B)](
        du, weight, bounds, dx, S, dx.stride(0), dx.stride(1), C=C, VARLEN=varlen, BLOCK_T=bt, BLOCK_C=128,
        num_warps=2,
    )
    return dw_part.sum(0).to(weight.dtype), alog_part.sum(0).to(A_log.dtype), dt_part.sum(0).to(dt_bias.dtype)


class _FusedPreGDR(torch.autograd.Function):
    """qkv, b, a given separately; the backward returns a gradient for each."""

    @staticmethod
    def forward(ctx, qkv, b, a, weight, A_log, dt_bias, cu_seqlens, nk, K, V):
        qkv, b, a = _row_view(qkv), _row_view(b), _row_view(a)
        weight = weight.contiguous()
        q, k, v, g, beta, bounds = _forward(qkv, b, a, weight, A_log, dt_bias, cu_seqlens, nk, K, V)
        ctx.save_for_backward(qkv, b, a, weight, A_log, dt_bias, bounds)
        ctx.varlen = cu_seqlens is not None
        ctx.dims = (nk, K, V)
        return q, k, v, g, beta

    @staticmethod
    def backward(ctx, dq, dk, dv, dg, dbeta):
        qkv, b, a, weight, A_log, dt_bias, bounds = ctx.saved_tensors
        dx, db, da = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (qkv, b, a))
        dw, dalog, ddt = _backward(qkv, b, a, weight, A_log, dt_bias, bounds, ctx.varlen, *ctx.dims,
                                   dq, dk, dv, dg, dbeta, dx, db, da)
        return dx, db, da, dw, dalog, ddt, None, None, None, None


class _FusedPreGDRFromProj(torch.autograd.Function):
    """The whole in_proj output [B, S, qkv | z | b | a] in, one gradient tensor of that shape out.

    With the split done outside (``fused_pre_gdr`` on torch.split views), autograd's split backward
    concatenates dqkv, dz, db, da into a fresh tensor: a cat kernel per layer and a second
    [B, S, D] buffer. Here the kernels write dqkv, db and da straight into their columns of one
    buffer, and dz is copied into its columns."""

    @staticmethod
    def forward(ctx, proj, weight, A_log, dt_bias, cu_seqlens, nk, K, V, nv):
        proj = _row_view(proj)
        C, vd = 2 * nk * K + nv * V, nv * V
        if proj.shape[-1] != C + vd + 2 * nv:
            raise ValueError(f"in_proj width {proj.shape[-1]} is not 2*{nk}*{K} + 2*{nv}*{V} + 2*{nv}")
        qkv, z, b, a = torch.split(proj, [C, vd, nv, nv], dim=-1)
        weight = weight.contiguous()
        q, k, v, g, beta, bounds = _forward(qkv, b, a, weight, A_log, dt_bias, cu_seqlens, nk, K, V)
        ctx.save_for_backward(proj, weight, A_log, dt_bias, bounds)
        ctx.varlen = cu_seqlens is not None
        ctx.dims = (nk, K, V, nv)
        # z is returned as a view of the input, not a copy: autograd supports view outputs of a
        # custom Function (its gradient still arrives here as dz, and it shares proj's memory as the
        # torch.split view did before). The one restriction, an error on in-place changes to z or to
        # a view of it, does not bind: the gated norm only reads it. A copy would cost a [B, S, vd]
        # write per layer, which is what this Function exists to save.
        return q, k, v, g, beta, z

    @staticmethod
    def backward(ctx, dq, dk, dv, dg, dbeta, dz):
        proj, weight, A_log, dt_bias, bounds = ctx.saved_tensors
        nk, K, V, nv = ctx.dims
        C, vd = 2 * nk * K + nv * V, nv * V
        qkv, _, b, a = torch.split(proj, [C, vd, nv, nv], dim=-1)
        # the gradient takes proj's strides (empty_like keeps a dense layout): for the [B, S, D]
        # transpose of in_proj's [S, B, D] output, its transpose back is contiguous for in_proj's
        # backward
        dproj = torch.empty_like(proj)
        if dproj.stride(-1) != 1:
            dproj = torch.empty(proj.shape, device=proj.device, dtype=proj.dtype)
        dx, dzs, db, da = torch.split(dproj, [C, vd, nv, nv], dim=-1)
        if dz is None:  # no gradient reached z (autograd materialises one as zeros by default): zeros
            dzs.zero_()
        else:
            dzs.copy_(dz)
        dw, dalog, ddt = _backward(qkv, b, a, weight, A_log, dt_bias, bounds, ctx.varlen, nk, K, V,
                                   dq, dk, dv, dg, dbeta, dx, db, da)
        return dproj, dw, dalog, ddt, None, None, None, None, None


def _tokens_per_program(S: int, rows: int) -> int:
    """Enough programs to fill the GPU a few times over, few enough that partial sums stay small."""
    if interpreting():
        return 32  # one block per program (see _configs)
    want = triton.next_power_of_2(max(1, S * rows // 2048))
    return max(32, min(512, want))


def fused_pre_gdr(qkv, b, a, weight, A_log, dt_bias, cu_seqlens, num_k_heads: int, head_k_dim: int,
                  head_v_dim: int):
    """Same inputs and outputs as ``pre_gdr_reference``, through the fused Triton kernels."""
    return _FusedPreGDR.apply(qkv, b, a, weight, A_log, dt_bias, cu_seqlens, num_k_heads, head_k_dim, head_v_dim)


def fused_pre_gdr_from_proj(proj, weight, A_log, dt_bias, cu_seqlens, num_k_heads: int, head_k_dim: int,
                            head_v_dim: int, num_v_heads: int):
    """``fused_pre_gdr`` on the whole in_proj output ``proj`` [B, S, qkv | z | b | a] (widths
    2*nk*K + nv*V, nv*V, nv, nv; any view with unit channel stride, e.g. the transpose of
    [S, B, D]). Returns q, k, v, g, beta as ``fused_pre_gdr`` and z [B, S, nv*V], a view of proj.
    proj's gradient is one tensor the backward kernels write in place: no cat after them."""
    return _FusedPreGDRFromProj.apply(proj, weight, A_log, dt_bias, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
                                      num_v_heads)


@functools.cache
def warn_fallback(reason: str) -> None:
    """One warning per distinct reason when the model asked for the fused path but cannot use it."""
    logging.getLogger(__name__).warning("fused pre-GDR requested but not used: %s; using the PyTorch path", reason)
