"""Memory-bound steps around the optimizer, timed on one GPU: what each costs and what could replace it.

    python scripts/bench_grad_paths.py

1. Adding bf16 parameter gradients into fp32 ``main_grad`` (what DDP's hook or a backward graph
   does per parameter), for one 2B decoder layer's shapes x 24, inside a CUDA graph: torch's
   mixed-dtype ``add_``, ``_foreach_add_``, ``add_(g.float())`` and a plain Triton kernel.
2. The weight-gradient GEMM: bf16 output then an fp32 add, against ``addmm(out_dtype=float32)``
   straight into main_grad (``model.grad_accum_fusion``).
3. AdamW over 2.18B fp32 elements in 343 tensors: torch's ``_fused_adamw_`` plus the fp32 -> bf16
   parameter copy, against one Triton kernel that also writes the bf16 copy.
Prints milliseconds and GB/s over the bytes each must move. Figures: docs/kernels.md (weight-gradient
accumulation fusion).
"""
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

if not torch.cuda.is_available():
    sys.exit("bench_grad_paths.py needs a CUDA device")
torch.manual_seed(0)
dev = "cuda"

def gb(nbytes, ms): return nbytes / ms / 1e6

# ---- 1. fp32 main_grad += bf16 grad, for one decoder layer's parameter shapes x 24
shapes = [(8224, 2048), (2048, 4096), (12288, 2048), (2048, 6144), (2048,), (2048,), (16,), (6144, 4)]
mgs = [torch.randn(s, device=dev) for s in shapes for _ in range(24)]
gs = [torch.randn(s, device=dev).bfloat16() for s in shapes for _ in range(24)]
n = sum(t.numel() for t in mgs)
print(f"accumulate: {len(mgs)} tensors, {n/1e6:.0f}M elements")

@triton.jit
def _acc(dst, src, N, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(dst + o, tl.load(dst + o, mask=m) + tl.load(src + o, mask=m).to(tl.float32), mask=m)

def triton_acc():
    for d, s in zip(mgs, gs):
        N = d.numel(); _acc[(triton.cdiv(N, 4096),)](d, s, N, BLOCK=4096, num_warps=8)

def graphed(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g): fn()
    torch.cuda.current_stream().wait_stream(s)
    return g.replay

for name, fn in [("torch add_ (mixed)", lambda: [d.add_(s) for d, s in zip(mgs, gs)]),
                 ("foreach_add_ (mixed)", lambda: torch._foreach_add_(mgs, gs)),
                 ("add_(g.float())", lambda: [d.add_(s.float()) for d, s in zip(mgs, gs)]),
                 ("triton acc", triton_acc)]:
    try:
        r = graphed(fn); ms = do_bench(r, warmup=3, rep=100)
        print(f"  {name:24} {ms:7.3f} ms (graphed)  {gb(n*10, ms):6.0f} GB/s")
    except Exception as e:
        print(f"  {name:24} failed {type(e).__name__}: {e}")
print(f"  copy of the same bytes: {do_bench(lambda: mgs[0].copy_(mgs[1])):.3f}")

# ---- 2. wgrad GEMM: bf16 out then add, vs addmm out_dtype=fp32 into main_grad
T = 8192
for (o, i) in [(8224, 2048), (12288, 2048), (2048, 6144), (2048, 4096)]:
    x = torch.randn(T, i, device=dev).bfloat16(); gy = torch.randn(T, o, device=dev).bfloat16()
    mg = torch.zeros(o, i, device=dev)
    a = do_bench(lambda: torch.mm(gy.t(), x), rep=100)
    b = do_bench(lambda: mg.add_(torch.mm(gy.t(), x)), rep=100)
    try:
        c = do_bench(lambda: torch.addmm(mg, gy.t(), x, out_dtype=torch.float32, out=mg), rep=100)
    except Exception as e:
        c = float("nan"); print(e)
    tf = 2 * T * o * i / 1e9
    print(f"wgrad [{o}x{i}] T={T}: bf16 mm {a:.3f} ms ({tf/a:.0f} TF/s), mm+add {b:.3f}, addmm fp32 out {c:.3f} ({tf/c:.0f} TF/s)")

# ---- 3. AdamW over 2.2B elements in 24x8 tensors + a 0.5B embedding: torch fused vs a Triton kernel
sizes = [s for s in shapes for _ in range(24)]
sizes = [torch.Size(s) for s in sizes] + [torch.Size((248320, 2048))] + [torch.Size((1024, 1024))] * 150
ps = [torch.randn(s, device=dev) for s in sizes]
grads = [torch.randn(s, device=dev) for s in sizes]
ms_ = [torch.zeros(s, device=dev) for s in sizes]
vs_ = [torch.zeros(s, device=dev) for s in sizes]
steps = [torch.tensor(1.0, device=dev) for _ in sizes]
N = sum(p.numel() for p in ps)
print(f"adamw: {len(ps)} tensors, {N/1e9:.2f}B elements")
def torch_fused():
    torch._fused_adamw_(ps, grads, ms_, vs_, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
                        amsgrad=False, maximize=False)
t = do_bench(torch_fused, warmup=3, rep=200)
print(f"  torch _fused_adamw_      {t:7.3f} ms  {gb(N*28, t):6.0f} GB/s")
bf = [p.bfloat16() for p in ps]
t2 = do_bench(lambda: torch._foreach_copy_(bf, ps), rep=100)
print(f"  foreach copy fp32->bf16  {t2:7.3f} ms  {gb(N*6, t2):6.0f} GB/s")

@triton.jit
def _adamw(table, p16_table, lr, b1, b2, eps, wd, bc1, bc2, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = table + pid * 6
    p_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    start = tl.load(row + 4)
    n = tl.load(row + 5)
    h_ptr = tl.load(p16_table + pid).to(tl.pointer_type(tl.bfloat16))
    o = start + tl.arange(0, BLOCK)
    msk = o < n
    p = tl.load(p_ptr + o, mask=msk); g = tl.load(g_ptr + o, mask=msk)
    m = tl.load(m_ptr + o, mask=msk); v = tl.load(v_ptr + o, mask=msk)
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    upd = (m / bc1) / (tl.sqrt(v / bc2) + eps)
    p = p - lr * upd
    tl.store(p_ptr + o, p, mask=msk); tl.store(m_ptr + o, m, mask=msk); tl.store(v_ptr + o, v, mask=msk)
    tl.store(h_ptr + o, p.to(tl.bfloat16), mask=msk)

for BLOCK in (2048, 4096, 8192):
    rows, hrows = [], []
    for p, g, m, v, h in zip(ps, grads, ms_, vs_, bf):
        for s in range(0, p.numel(), BLOCK):
            rows.append([p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), s, p.numel()]); hrows.append(h.data_ptr())
    table = torch.tensor(rows, dtype=torch.int64, device=dev); htab = torch.tensor(hrows, dtype=torch.int64, device=dev)
    for nw in (4, 8):
        fn = lambda: _adamw[(len(rows),)](table, htab, 1e-4, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05, BLOCK=BLOCK, num_warps=nw)
        t3 = do_bench(fn, warmup=3, rep=200)
        print(f"  triton adamw+bf16 BLOCK={BLOCK} warps={nw} {t3:7.3f} ms  {gb(N*30, t3):6.0f} GB/s  (torch fused + copy {t+t2:.3f})")
