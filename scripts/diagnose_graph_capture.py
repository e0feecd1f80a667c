"""Which parts of a decoder layer can be captured in a CUDA graph (a debugging aid for train.cuda_graphs).

    python scripts/diagnose_graph_capture.py [--config configs/qwen35_vl_2b.yaml] [key=value ...] [--json OUT]

A failed capture only says "operation failed due to a previous error during capture"; this
tries the pieces one by one (each after two eager warm-up passes on a side stream) and
reports, per piece, "ok" or the first error with the innermost frames:
- a GDN layer and a full-attention layer, eager forward+backward under
  ``torch.cuda.set_sync_debug_mode("error")`` (finds host syncs);
- the same layers captured forward only, and forward+backward with and without the
  weight-gradient fusion;
- fla's chunked delta rule and the varlen attention kernel alone, forward+backward.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _error(e: BaseException) -> str:
    frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
              for f in traceback.extract_tb(e.__traceback__)[-6:]]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} @ " + " <- ".join(reversed(frames))


def try_capture(fn) -> str:
    """Warm up and capture on the current stream (the trainer's side stream; see
    models/common/layer_graphs.py use_side_stream)."""
    try:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return "warm-up failed: " + _error(e)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return _error(e)


def try_sync_free(fn) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return _error(e)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/qwen35_vl_2b.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--json")
    args = ap.parse_intermixed_args(argv)
    from kernels.gated_delta_rule import chunk_gated_delta_rule
    from models.common.attention import attention
    from models.common.layer_graphs import StaticBatch, flash_qla_heads
    from models.qwen35_vl.attention import MRopeSelfAttention
    from models.qwen35_vl.mrope import mrope_angles
    from multimodal.forward_step import packed_seq_params
    from scripts.check_layer_graphs_gpu import trainer_model_and_batches

    cfg, model, ddp, fused, (batch,) = trainer_model_and_batches(args.config, args.overrides, 1)
    m, t = cfg.model, cfg.train
    params = packed_seq_params(batch)
    pos = batch["position_ids"]
    lm = model.language_model
    rope = pos if lm.fused_mrope else mrope_angles(pos, lm.mrope_inv_freq, lm.mrope_axis).transpose(0, 1).unsqueeze(2)
    layers = list(model.language_model.decoder.layers)
    static = StaticBatch(t.seq_length, t.cuda_graph_max_samples, rope, "cuda",
                         flash_qla_heads=flash_qla_heads(layers))  # as the trainer's graphs
    static.load(params, rope)
    gdn = next(layer for layer in layers if not isinstance(layer.self_attention, MRopeSelfAttention))
    full = next(layer for layer in layers if isinstance(layer.self_attention, MRopeSelfAttention))
    x = (torch.randn(t.seq_length, 1, m.hidden_size, device="cuda") * 0.5).bfloat16().requires_grad_()
    gout = torch.randn_like(x) * 1e-3
    kw = dict(attention_mask=None, rotary_pos_emb=static.rope, packed_seq_params=static.params)
    results = {"device": torch.cuda.get_device_name(), "fused_wgrad_layers": fused}

    def set_fusion(on: bool):
        for mod in model.modules():
            if hasattr(getattr(mod, "weight", None), "main_grad") and hasattr(mod, "gradient_accumulation_fusion"):
                mod.gradient_accumulation_fusion = on and fused > 0

    def fwd(layer):
        return lambda: layer(hidden_states=x, **kw)[0]

    def fwd_bwd(layer):
        def run():
            out = layer(hidden_states=x, **kw)[0]
            torch.autograd.grad(out, [x, *layer.parameters()], gout, allow_unused=True)
        return run

    for name, layer in (("gdn_layer", gdn), ("attention_layer", full)):
        set_fusion(False)
        results[f"{name}_sync_free_fwd_bwd"] = try_sync_free(fwd_bwd(layer))
        results[f"{name}_capture_fwd"] = try_capture(fwd(layer))
        results[f"{name}_capture_fwd_bwd_plain_wgrad"] = try_capture(fwd_bwd(layer))
        set_fusion(True)
        results[f"{name}_capture_fwd_bwd_fused_wgrad"] = try_capture(fwd_bwd(layer))
        print(json.dumps(results, indent=1), flush=True)

    T, H, D = t.seq_length, 16, 128
    q, k, v = (torch.randn(1, T, H, D, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    gate = (-torch.rand(1, T, H, device="cuda")).requires_grad_()
    beta = torch.rand(1, T, H, device="cuda").bfloat16().requires_grad_()
    ins = [q, k, v, gate, beta]

    def fla_fwd_bwd():
        out = chunk_gated_delta_rule(*ins, static.cu32, "fla", static.params.gdn_varlen)
        torch.autograd.grad(out, ins, torch.ones_like(out))

    def attn_fwd_bwd():
        out = attention(q[0], k[0], v[0], causal=True, cu_seqlens=static.cu32, max_seqlen=T, backend="varlen")
        torch.autograd.grad(out, [q, k, v], torch.ones_like(out))

    results["fla_gdn_capture_fwd_bwd"] = try_capture(fla_fwd_bwd)
    results["varlen_attention_capture_fwd_bwd"] = try_capture(attn_fwd_bwd)
    print(json.dumps(results, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
