"""MoE all-to-all overlap (``parallel.moe_a2a_overlap``): the multimodal schedule plan against the
plain forward, the config refusals, the NVTX ranges, and overlap on vs off in the trainer.

CPU stand-ins (test only, production code unchanged): megatron's combined-1F1B schedule runs its
nodes on CUDA streams and orders them with CUDA events; a CPU build of torch has neither. Here
the megatron modules of that schedule see ``multimodal.platform``'s CPU ``torch`` stand-in
(streams, events and ``torch.cuda.stream`` are no-ops: on one CPU thread every op is already
ordered) and ``Tensor.record_stream`` is a no-op. The schedule itself (node split, order,
detach/backward wiring, freeing of inputs) is megatron's, unchanged. What the CPU cannot show is
concurrency: the all-to-alls do not actually overlap here, only the GPU benchmark measures that
(scripts/bench_moe_overlap.py).

The trainer test runs two gloo processes (ep=2, two micro-batches per rank per step) in bf16,
as megatron insists for the overlap; megatron's bf16 optimizer accepts only parameters whose
``type()`` names a CUDA tensor, so the worker applies platform's existing CUDA-type-name shim
(the one it already uses for the distributed optimizer) to it as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MOE = "configs/qwen35_vl_proxy_moe.yaml"

# megatron modules of the combined-1F1B path that create or use CUDA streams / events
STREAM_MODULES = (
    "megatron.core.pipeline_parallel.combined_1f1b",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.models.common.model_chunk_schedule_plan",
    "megatron.core.models.common.utils",
    "megatron.core.models.gpt.fine_grained_callables",
)


class _Event:
    """A CUDA event on one CPU thread: everything recorded has already happened."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def cpu_stream_stand_ins(setattr_=setattr) -> None:
    """Give the schedule's megatron modules the CPU torch stand-in (see the module docstring)."""
    import importlib

    from multimodal.platform import _CpuStreams, _CudaToCpuTorch, apply_cpu_patches

    class Cuda(_CpuStreams):  # platform's stand-in plus events that megatron's plan records / waits on
        Event = staticmethod(lambda *a, **k: _Event())

    class Torch(_CudaToCpuTorch):
        cuda = Cuda()

    apply_cpu_patches()
    from multimodal import platform

    setattr_(platform, "CPU_STREAM_STAND_INS", True)  # tells the trainer the streams are stubbed
    for name in STREAM_MODULES:
        setattr_(importlib.import_module(name), "torch", Torch())
    setattr_(torch.Tensor, "record_stream", lambda self, stream: None)


# ---------------------------------------------------------------- in-process (world 1, fp32)


def _model_and_batch(overrides=()):
    from data.loader import MicroBatchIterator, build_dataset
    from models import get_model_builder
    from multimodal.config import load_config
    from core.seeding import seed_everything

    cfg = load_config(MOE, ["train.seq_length=256", "data.mock.max_image_side=64", "model.attention_backend=sdpa",
                            "model.gdn_backend=torch", "model.moe_aux_loss_coeff=0.1", *overrides])
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    m = cfg.model
    loader = MicroBatchIterator.from_config(build_dataset(m, cfg.data, 256), m, cfg.data, cfg.train)
    batch = next(iter(loader))
    assert batch["padding_mask"].any() and batch["pixel_values"].numel()  # padding and images
    return cfg, model, batch


def _forward_step(cfg):
    """ForwardStep as the trainer builds it for the recipe's model (its family's row extras)."""
    from models import get_model_family
    from multimodal.forward_step import ForwardStep

    return ForwardStep(torch.device("cpu"), torch.float32, image_token_id=cfg.model.image_token_id,
                       row_extras=get_model_family(cfg.model.name).packed_row_extras)


def _step(model, batch, cfg, plan: bool):
    """Loss and all gradients of one micro-batch: the plain forward, or the plan run forward then
    backward the way combined_forward_backward_step does (loss on a detached copy of the output)."""
    from models.common.schedule_plan import MultimodalSchedulePlan

    model.zero_grad(set_to_none=True)
    step = _forward_step(cfg)
    out, loss_fn = step(iter([batch]), model, return_schedule_plan=plan)
    if plan:
        assert isinstance(out, MultimodalSchedulePlan)
        schedule, out = out, MultimodalSchedulePlan.run(out, None)  # forward of every node
        detached = out.detach().requires_grad_()
        loss, _, _ = loss_fn(detached)
        loss.backward()
        MultimodalSchedulePlan.run(None, schedule, b_grad=detached.grad)  # backward of every node
    else:
        loss, _, _ = loss_fn(out)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), loss.detach(), grads


@pytest.fixture
def streams(mcore, monkeypatch):
    """Stream stand-ins, and no early freeing of node inputs: in one process (ep=1) the alltoall
    dispatcher's dispatch and combine are identities, so a node's input *is* its output, and
    megatron's memory saving (free the all-to-all's input once it has been sent, valid for ep > 1,
    which megatron asserts for the overlap) would free live data. The ep=2 trainer test below
    runs with the freeing on."""
    cpu_stream_stand_ins(monkeypatch.setattr)
    from megatron.core.models.common import utils

    monkeypatch.setattr(utils, "should_free_input", lambda *a, **k: False)


def test_plan_has_megatron_nodes_per_layer(streams):
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

    from models.common.schedule_plan import MultimodalPreProcessNode
    from models.qwen35_vl.attention import MRopeSelfAttention
    from models.qwen35_vl.gdn import Qwen35GatedDeltaNet

    cfg, model, batch = _model_and_batch()
    step = _forward_step(cfg)
    plan, _ = step(iter([batch]), model, return_schedule_plan=True)
    assert isinstance(plan, TransformerModelChunkSchedulePlan)  # what megatron's schedule asserts
    assert isinstance(plan.pre_process, MultimodalPreProcessNode) and plan.post_process is not None
    assert plan.num_layers() == cfg.model.num_layers
    # every layer: mixer (+ norm, shared expert, router) | dispatch | experts | combine
    assert plan.node_names() == [["pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine"]] * 4
    mixers = [type(plan.get_layer(i).layer.self_attention) for i in range(4)]
    assert mixers == [Qwen35GatedDeltaNet] * 3 + [MRopeSelfAttention]  # the proxy's hybrid pattern
    assert plan.state.padding_mask is not None and plan.state.packed_seq_params.qkv_format == "thd"
    assert plan.state.decoder_input is None  # filled by the pre-process node (vision runs then)


@pytest.mark.parametrize("recompute, overrides", [
    ([], []), (["shared_experts", "gdn_qkv", "gdn_norm_out", "core_attn"], []), ([], ["model.mtp_num_layers=1"])],
    ids=["plain", "recompute", "mtp"])
def test_plan_matches_plain_forward_and_backward(streams, recompute, overrides):
    """fp32, one process: per-token losses, the loss and every gradient (vision encoder, embedding,
    GDN, attention, router, shared and routed experts, output layer) equal the plain forward's,
    with packing, padding (kept out of routing) and images in the micro-batch; also with the
    selective recompute modules that validation allows next to the overlap, and with an MTP head
    (its MoE layer, and the gradient its input embeddings send back to the embedding and the
    vision encoder across the plan's nodes)."""
    cfg, model, batch = _model_and_batch(overrides)
    if recompute:
        from multimodal.performance.recompute import apply_recompute

        assert apply_recompute(model, recompute) > 0
    out_ref, loss_ref, grads_ref = _step(model, batch, cfg, plan=False)
    out, loss, grads = _step(model, batch, cfg, plan=True)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)  # same ops in the same order
    assert loss == loss_ref
    assert grads.keys() == grads_ref.keys()
    assert any(n.startswith("vision_model.") for n in grads) and any("router" in n for n in grads)
    if overrides:  # the MTP layer (MoE, routed with the padding mask) trained through the plan
        assert any(".mtp." in n and "router" in n for n in grads)
    # observed bit for bit: the plan cuts the graph into per-node segments (detached inputs whose
    # .grad feeds the next segment's backward), but every gradient is still the sum of the same
    # terms in the same order
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=0, msg=name)


def test_plan_routes_without_padding(streams, monkeypatch):
    """Without our routing mask (megatron's layer plan as is) the padding is routed and counted by
    the load-balancing loss, and the router gradient moves: the wrapper is needed."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan

    from models.common.schedule_plan import MultimodalLayerPlan

    cfg, model, batch = _model_and_batch()
    _, _, grads_ref = _step(model, batch, cfg, plan=False)
    monkeypatch.setattr(MultimodalLayerPlan, "_build_callable_nodes", TransformerLayerSchedulePlan._build_callable_nodes)
    _, _, grads = _step(model, batch, cfg, plan=True)
    router = [n for n in grads_ref if "router" in n]
    assert any(not torch.allclose(grads[n], grads_ref[n], rtol=1e-3, atol=1e-6) for n in router)


def test_nvtx_ranges_mark_moe_phases(mcore, monkeypatch):
    from models.common.moe_nvtx import PHASES, add_moe_nvtx_ranges

    cfg, model, batch = _model_and_batch(["model.num_layers=1", "model.full_attention_interval=1"])
    assert add_moe_nvtx_ranges(model) == 0  # no GPU: untouched
    events = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: events.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append(("pop", None)))
    assert add_moe_nvtx_ranges(model, enabled=True) == len(PHASES)
    assert add_moe_nvtx_ranges(model, enabled=True) == 0  # idempotent
    _step(model, batch, cfg, plan=False)
    pushed = [name for kind, name in events if kind == "push"]
    assert pushed == ["moe/shared_experts", "moe/dispatch", "moe/experts", "moe/combine"]
    assert len(events) == 2 * len(pushed)


# ---------------------------------------------------------------- config refusals


@pytest.mark.parametrize("overrides, needle", [
    (["model.num_experts=0", "parallel.ep=1"], "needs an MoE model"),
    (["parallel.ep=1"], "parallel.ep >= 2"),
    (["model.moe_token_dispatcher=allgather"], "moe_token_dispatcher=alltoall"),
    (["train.precision=fp32"], "train.precision=bf16"),
    (["parallel.pp=2"], "parallel.pp=1"),
    (["train.recompute_modules=[layernorm]"], "drop 'layernorm'"),
])
def test_overlap_refusals_name_the_fix(overrides, needle):
    from multimodal.config import ConfigError, load_config, validate

    cfg = load_config(MOE, ["parallel.moe_a2a_overlap=true", "parallel.ep=2", "train.precision=bf16",
                            "train.global_batch_size=4", *overrides])
    with pytest.raises(ConfigError, match="moe_a2a_overlap") as err:
        validate(cfg, world_size=4)
    assert needle in str(err.value)


def test_overlap_accepted_and_passed_to_megatron():
    from models.qwen35_vl.model import transformer_config
    from multimodal.config import ConfigError, load_config, validate

    cfg = load_config(MOE, ["parallel.moe_a2a_overlap=true", "parallel.ep=2", "train.precision=bf16",
                            "train.global_batch_size=4", "train.recompute_modules=[shared_experts,gdn_qkv]"])
    validate(cfg, world_size=2)
    assert transformer_config(cfg.model, cfg.parallel, torch.bfloat16).overlap_moe_expert_parallel_comm
    # precision=auto passes validation; on a CPU it resolves to fp32, which the builder refuses
    with pytest.raises(ConfigError, match="train.precision=bf16"):
        transformer_config(cfg.model, cfg.parallel, torch.float32)


# ---------------------------------------------------------------- trainer, 2 processes, ep=2, bf16

STEPS = 3
TRAIN = [f"train.iters={STEPS}", "train.seq_length=256", "train.global_batch_size=4", "parallel.ep=2",
         "train.precision=bf16", "data.mock.max_image_side=64", "checkpoint.dir=null", "logging.progress_bar=false",
         "logging.tensorboard=false", "model.attention_backend=sdpa", "model.gdn_backend=torch"]
# Observed on 2 CPU cores: identical losses and grad norms at every step (|diff| = 0), as in the
# fp32 one-process test above: the overlapped schedule runs the same kernels on the same inputs
# and sums every gradient in the same order, and on one CPU thread per rank nothing runs
# concurrently. So equality is asserted; if a megatron upgrade reorders a gradient sum, expect
# bf16 last-bit differences (~1e-3 in the loss after a few Adam steps), not a wiring error,
# which moves the loss by > 1e-1 by step 3 at this learning rate.
LOSS_TOL = 0.0
GRAD_NORM_RTOL = 0.0
# With one MTP depth (the head runs in the plan's post-process node) the first loss is still
# identical (the fp32 one-process test above is exact with MTP too), but weights the LM loss and
# the MTP loss both reach (the LM head, which the MTP depth shares) get their two terms in two
# backward calls (the loss's, then the post-process node's): each bf16 term is added to the fp32
# main_grad on its own, where the plain backward adds their bf16 sum once. Observed |loss diff|
# 8.5e-6 and grad-norm rel. diff 8.7e-5 by step 3; a gradient path cut between nodes moves the
# loss by > 1e-1.
MTP_LOSS_TOL = 1e-4
MTP_GRAD_NORM_RTOL = 1e-3
MODES = {"off": [], "on": [], "off_mtp": ["model.mtp_num_layers=1"], "on_mtp": ["model.mtp_num_layers=1"]}


def _worker(out: Path, overrides: list[str]) -> None:
    import torch.distributed as dist
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from models.common import schedule_plan
    from multimodal import platform
    from multimodal.config import load_config
    from multimodal.training import train

    cpu_stream_stand_ins()
    f16 = mcore_optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = platform._with_cuda_type_names(f16.__init__)
    calls = {"plans": 0, "overlapped": 0}
    init, run = schedule_plan.MultimodalSchedulePlan.__init__, schedule_plan.MultimodalSchedulePlan.run

    def counting_init(self, *a, **k):
        calls["plans"] += 1
        init(self, *a, **k)

    def counting_run(f_plan, b_plan, *a, **k):  # forward of one micro-batch with backward of another
        calls["overlapped"] += f_plan is not None and b_plan is not None
        return run(f_plan, b_plan, *a, **k)

    schedule_plan.MultimodalSchedulePlan.__init__ = counting_init
    schedule_plan.MultimodalSchedulePlan.run = staticmethod(counting_run)
    result = {}
    for mode, extra in MODES.items():
        calls.update(plans=0, overlapped=0)
        cfg = load_config(MOE, [*overrides, *extra, f"parallel.moe_a2a_overlap={mode.startswith('on')}",
                                f"logging.dir={out / mode}"])
        res = train(cfg)
        rank = int(os.environ["RANK"])
        rows = [json.loads(x) for x in (out / mode / "metrics.jsonl").read_text().splitlines()] if rank == 0 else []
        result[mode] = {"losses": res.losses, "grad_norms": {r["step"]: r["grad_norm"] for r in rows},
                        "mtp_losses": {r["step"]: r.get("mtp_loss") for r in rows}, **calls}
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
def test_overlap_on_matches_off_ep2(tmp_path):
    from test_parallel import _free_port

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           __file__, str(tmp_path), *TRAIN]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    micro = 4 // 2  # global batch / (micro-batch x DP): EP=2 on 2 ranks is DP=2
    for res in results:
        for off, on in (("off", "on"), ("off_mtp", "on_mtp")):
            assert res[off]["plans"] == 0 and res[off]["overlapped"] == 0
            assert res[on]["plans"] == STEPS * micro  # every micro-batch went through the plan
            assert res[on]["overlapped"] == STEPS * (micro - 1)  # and was interleaved with another
            assert res[on]["losses"] == results[0][on]["losses"]  # both ranks log the global loss
    for suffix, loss_tol, grad_rtol in (("", LOSS_TOL, GRAD_NORM_RTOL), ("_mtp", MTP_LOSS_TOL, MTP_GRAD_NORM_RTOL)):
        off, on = results[0]["off" + suffix], results[0]["on" + suffix]
        steps = sorted(off["losses"], key=int)
        assert len(steps) == STEPS and sorted(on["losses"], key=int) == steps
        dloss = max(abs(on["losses"][s] - off["losses"][s]) for s in steps)
        dgrad = max(abs(on["grad_norms"][s] - off["grad_norms"][s]) / off["grad_norms"][s] for s in steps)
        print(f"PARITY moe_a2a_overlap on vs off (ep=2, bf16{', one MTP depth' if suffix else ''}): max |loss diff| "
              f"{dloss:.3g}, max grad-norm rel diff {dgrad:.3g}; losses off {off['losses']} on {on['losses']}")
        assert on["losses"][steps[0]] == off["losses"][steps[0]]  # the first forward is the same computation
        assert dloss <= loss_tol and dgrad <= grad_rtol
        assert on["losses"][steps[-1]] < on["losses"][steps[0]]  # it trains
    off, on = results[0]["off_mtp"], results[0]["on_mtp"]
    assert on["mtp_losses"][steps[0]] == off["mtp_losses"][steps[0]] and None not in off["mtp_losses"].values()
    assert max(abs(on["mtp_losses"][s] - off["mtp_losses"][s]) for s in steps) <= MTP_LOSS_TOL


if __name__ == "__main__":  # torchrun worker: tests/test_moe_overlap.py OUT_DIR key=value ...
    _worker(Path(sys.argv[1]), sys.argv[2:])


def test_cpu_run_refuses_the_overlap_with_the_fix(mcore):
    """Without a GPU (and without the test's stream stand-ins) the trainer stops at start-up
    with a message, not inside megatron's schedule."""
    from multimodal.config import ConfigError, load_config
    from multimodal.training import train

    cfg = load_config(MOE, ["parallel.moe_a2a_overlap=true", "parallel.ep=2", "train.precision=bf16"])
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="needs GPUs"):
        train(cfg)
