"""Decoder layers as CUDA graphs (train.cuda_graphs) against the eager layers, on a GPU.

    python tests/gpu/test_layer_graphs_gpu.py [--config configs/qwen35_vl_2b.yaml] [key=value ...] [--json OUT]

1. fla's GDN with the graphs' padded metadata (cu_seqlens with empty tail segments, the chunk
   table padded with rows aimed at an always-empty segment) vs the real metadata: outputs and
   input gradients must be bit-identical.
2. The model (bf16, DDP, weight-gradient fusion as in training) on the recipe's own packed
   micro-batches, with gradient accumulation: eager twice (the run-to-run noise of the atomics
   in flash attention's and fla's backward), then with graphs twice (capture, then replay only).
   Losses must be bit-identical (every forward kernel is deterministic) and main_grad must
   differ from eager by no more than eager differs from itself (x4, floor 1e-3 relative).
3. Time per micro-batch forward+backward, eager vs graphs.
4. The vision encoder's graphs added (train.cuda_graphs.vision_bucket): its input is padded, so
   its GEMMs may round differently; losses within 5e-3 relative, gradients within the bound
   above, and the time per micro-batch with both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest
import torch


def check_padded_gdn() -> dict:
    from fused_kernels.gated_delta_rule import FLA_CHUNK_SIZE, GDNVarlen, chunk_gated_delta_rule
    from models.performance.layer_graphs import StaticBatch
    from models.common.packed_seq import PackedRowParams
    from models.qwen35_vl.layer_hooks import GDNGraphRows

    lens = [1000, 37, 3000, 2100, 2055]  # 8192 tokens, chunks that end mid-chunk
    T, H, D = sum(lens), 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q = torch.nn.functional.normalize(rnd(1, T, H, D), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rnd(1, T, H, D), dim=-1).bfloat16()
    v = rnd(1, T, H, D).bfloat16()
    gate = -torch.nn.functional.softplus(rnd(1, T, H))
    beta = torch.sigmoid(rnd(1, T, H)).bfloat16()
    tensors = [t.requires_grad_() for t in (q, k, v, gate, beta)]
    cot = rnd(1, T, H, D).bfloat16()
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    real = GDNVarlen.from_host(cu, "cuda")
    static = StaticBatch(T, 16, torch.zeros(3, 1, T, dtype=torch.long, device="cuda"), "cuda")
    rows = GDNGraphRows(static.cu64, T, 16, one_segment=False)  # what Qwen3.5's graph_row_buffers makes
    params = PackedRowParams(qkv_format="thd", cu_seqlens_q=cu.cuda(), cu_seqlens_q_padded=cu.cuda(), mixer_varlen=real)
    static.load(params, static.rope)
    rows.load(params)
    results = []
    for varlen, cu_dev in ((real, cu.cuda()), (rows.fields["mixer_varlen"], static.cu32)):
        out = chunk_gated_delta_rule(*tensors, cu_dev, "fla", varlen)
        results.append((out, *torch.autograd.grad(out, tensors, cot)))
    same = all(torch.equal(a, b) for a, b in zip(*results))
    return {"padded_gdn_bit_identical": same, "chunk_rows_real": int(real.chunk_indices.shape[0]),
            "chunk_rows_static": int(rows.chunks.shape[0]), "chunk_size": FLA_CHUNK_SIZE}


def trainer_model_and_batches(config: str, overrides: list[str], micro_batches: int):
    """The model as the trainer builds it with train.cuda_graphs (side stream, bf16, DDP, the
    recipe's weight-gradient fusion) and the recipe's first packed micro-batches on the GPU.
    Returns (cfg, model, ddp, fused linear layers, batches)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from data.loader import MicroBatchIterator, build_dataset
    from models import get_model_builder, get_model_family
    from models.performance import layer_graphs, wgrad_fusion
    from multimodal.config import load_config, resolve_sources
    from multimodal.forward_step import to_device
    from multimodal.freeze import freeze
    from multimodal.lora import apply_lora
    from multimodal.platform import init_distributed
    from core.seeding import seed_everything

    cfg = load_config(config, overrides)
    resolve_sources(cfg)
    init_distributed()
    ps.initialize_model_parallel(1, 1)
    seed_everything(0)
    m, t = cfg.model, cfg.train
    layer_graphs.use_side_stream()
    model = get_model_builder(m.name)(m, cfg.parallel, torch.bfloat16).cuda()
    freeze(model, m.freeze)  # model.freeze / model.lora as training applies them: before DDP
    if m.lora.rank:
        apply_lora(model, m.lora)
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    # as training resolves it: the graphs below add into main_grad (stage 2 installs them so)
    fused = wgrad_fusion.enable(ddp) if wgrad_fusion.resolve(m.grad_accum_fusion, t.cuda_graphs.grads_to_main_grad) else 0
    dataset = build_dataset(m, cfg.data, t.seq_length)
    loader = iter(MicroBatchIterator.from_config(dataset, m, cfg.data, t))
    extras = get_model_family(m.name).packed_row_extras
    batches = [to_device(next(loader), torch.device("cuda"), torch.bfloat16, row_extras=extras)
               for _ in range(micro_batches)]
    return cfg, model, ddp, fused, batches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/qwen35_vl_2b.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--micro-batches", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_intermixed_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from megatron.core import parallel_state as ps

    from models.performance import layer_graphs
    from multimodal.forward_step import packed_seq_params

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result.update(check_padded_gdn())
    print(json.dumps(result), flush=True)

    cfg, model, ddp, fused, batches = trainer_model_and_batches(args.config, args.overrides, args.micro_batches)
    t = cfg.train
    result["fused_wgrad_layers"] = fused
    result["samples_per_row"] = [len(b["sample_lengths"]) for b in batches]
    # The vision graphs pad a micro-batch's patches into a bucket whose padding rows are a segment of
    # their own, so they always run flash varlen; under `auto` the eager encoder gives a one-image
    # micro-batch cuDNN instead. Pin the eager reference to the graphs' kernel: stage 4 then
    # compares graphs with eager, not two attention kernels.
    for block in model.vision_model.blocks:
        block.attn_backend = "varlen"

    def micro_batch(batch):
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                     pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                     packed_seq_params=packed_seq_params(batch))
        (loss * batch["loss_mask"]).sum().backward()
        return loss.detach()

    def accumulate():
        ddp.zero_grad_buffer()
        return [micro_batch(b) for b in batches]

    def grads():
        return torch.cat([p.main_grad.flatten() for p in model.parameters() if p.requires_grad])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    def against_eager():
        """One accumulation: its losses, and its gradient's distance from the first eager run's. Only
        that one fp32 copy of the gradient is kept (each is 4 bytes a parameter: on an 80 GB card
        six of them did not fit beside the model and its graphs)."""
        losses = accumulate()
        return losses, rel(grads(), eager_grad)

    def timed(n=5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            accumulate()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n / len(batches) * 1e3

    eager_losses = accumulate()
    eager_grad = grads()
    eager_again = against_eager()
    result["eager_ms_per_micro_batch"] = timed()
    one_segment = layer_graphs.one_segment_set_wanted(cfg.model.attention_backend, torch.device("cuda"))
    graphs = layer_graphs.graph_decoder_layers(model.language_model, t.cuda_graphs.max_samples, one_segment_graphs=one_segment,
                                  grads_to_main_grad=t.cuda_graphs.grads_to_main_grad)
    graphed = [against_eager() for _ in range(2)]
    result["capture_failed"] = graphs.failed
    result["graphed_batches"] = graphs.graphed_batches
    result["eager_fallbacks"] = dict(graphs.eager_batches)
    result["graphs_ms_per_micro_batch"] = timed()
    result["losses_bit_identical"] = all(torch.equal(a, b) for run in graphed for a, b in zip(run[0], eager_losses))
    result["loss_max_abs_diff"] = max((a - b).abs().max().item() for run in graphed for a, b in zip(run[0], eager_losses))
    result["grad_rel_eager_vs_eager"] = eager_again[1]
    result["grad_rel_graphs_vs_eager"] = max(run[1] for run in graphed)
    bound = max(4 * result["grad_rel_eager_vs_eager"], 1e-3)
    result["passed"] = bool(
        result["padded_gdn_bit_identical"] and graphs.failed is None and not graphs.eager_batches
        and result["losses_bit_identical"] and result["grad_rel_graphs_vs_eager"] <= bound)
    result["speedup"] = result["eager_ms_per_micro_batch"] / result["graphs_ms_per_micro_batch"]
    # 4. the vision encoder's graphs on top (padded rows: its GEMMs may round differently, so the
    # losses are compared with a tolerance, the gradients against the same bound)
    vision = model.vision_model.install_cuda_graphs(t.cuda_graphs.vision_bucket, t.cuda_graphs.vision_max_buckets,
                                                    t.cuda_graphs.max_samples,
                                                    grads_to_main_grad=t.cuda_graphs.grads_to_main_grad)
    both = [against_eager() for _ in range(2)]
    result["vision_capture_failed"] = vision.failed
    result["vision_buckets"] = [list(key) for key in sorted(vision.buckets)]  # (rows, segment slots)
    result["vision_graphed_batches"] = vision.graphed_batches
    result["vision_eager_fallbacks"] = dict(vision.eager_batches)
    result["vision_graphs_ms_per_micro_batch"] = timed()
    result["vision_loss_max_rel_diff"] = max(
        ((a - b).abs().max() / b.abs().max()).item() for run in both for a, b in zip(run[0], eager_losses))
    result["grad_rel_vision_graphs_vs_eager"] = max(run[1] for run in both)
    result["vision_passed"] = bool(
        vision.failed is None and not vision.eager_batches and result["vision_loss_max_rel_diff"] <= 5e-3
        and result["grad_rel_vision_graphs_vs_eager"] <= bound)
    result["passed"] = result["passed"] and result["vision_passed"]
    result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ps.destroy_model_parallel()
    return 0 if result["passed"] else 1


@pytest.mark.gpu
def test_decoder_graphs_match_eager_layers(run_check):
    """The decoder's CUDA graphs give the eager layers' loss and gradients (2B recipe, one 8K row)."""
    run_check(__file__)


if __name__ == "__main__":
    sys.exit(main())
