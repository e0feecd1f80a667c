"""Step profiler: the trace summary (device busy time, attribution, categories) on a
hand-built trace with known answers, and a real CPU training run that writes its profile."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from multimodal.config import ConfigError, load_config, validate
from multimodal.observability.profiling import categorize, format_summary, summarize_trace


def _kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream}


def _step(n, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts, "dur": dur}


def test_summary_counts_overlap_once_and_attributes_late_kernels_to_their_step():
    events = [
        _step(1, 0, 100),
        _kernel("sm90_xmma_gemm_bf16", 10, 50),                 # gemm, stream 7
        _kernel("ncclDevKernel_AllReduce_Sum", 30, 40, 9),     # overlaps the gemm by 30 us
        _kernel("chunk_gated_delta_rule_fwd_kernel_h", 120, 30),  # runs after step 1's host span
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 150},  # GPU copy: not a step
        _step(2, 200, 50),
        _kernel("vectorized_elementwise_kernel", 210, 10),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 3},  # host op: not a kernel
    ]
    s1, s2 = summarize_trace(events)
    assert s1["step"] == "ProfilerStep#1" and s2["step"] == "ProfilerStep#2"
    assert s1["num_kernels"] == 3 and s2["num_kernels"] == 1
    assert s1["kernel_ms"] == pytest.approx(0.120)          # 50 + 40 + 30 us
    assert s1["device_busy_ms"] == pytest.approx(0.090)     # union: [10, 70) + [120, 150)
    assert s1["wall_ms"] == pytest.approx(0.150)            # until the late kernel ends
    assert s1["device_idle_fraction"] == pytest.approx(1 - 90 / 150)
    cats = {c["category"]: c["ms"] for c in s1["categories"]}
    assert cats == pytest.approx({"gemm": 0.05, "nccl": 0.04, "linear attention (fla/tilelang)": 0.03})
    assert s1["top_kernels"][0]["kernel"] == "sm90_xmma_gemm_bf16"
    assert s2["categories"][0]["category"] == "elementwise" and s2["device_idle_fraction"] == pytest.approx(0.8)
    text = format_summary([s1, s2])
    assert "idle 40.0%" in text and "[nccl] ncclDevKernel_AllReduce_Sum" in text


def test_idle_gaps_are_charged_to_the_top_level_host_op_that_launched_the_next_kernel():
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(corr, ts, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "tid": tid,
                "args": {"correlation": corr}}

    def kernel(corr, ts, dur):
        return {**_kernel(f"k{corr}", ts, dur), "args": {"correlation": corr}}

    events = [
        _step(1, 0, 1000),
        op("MyFunction", 100, 200), op("aten::mm", 150, 50),  # nested: the outer op is charged
        op("aten::add", 400, 50),
        op("autograd::engine::evaluate_function: MyFunctionBackward", 600, 100, tid=2),  # the backward thread
        launch(1, 160), launch(2, 420), launch(3, 650, tid=2),
        kernel(0, 10, 10),     # the first kernel: no gap before it
        kernel(1, 170, 20),    # idle 20 -> 170: 150 us, launched inside MyFunction (via aten::mm)
        kernel(2, 430, 10),    # idle 190 -> 430: 240 us, aten::add
        kernel(3, 660, 10),    # idle 440 -> 660: 220 us, the backward node
        kernel(4, 685, 5),     # 15 us after the previous one: normal spacing, not a gap
    ]
    (s,) = summarize_trace(events)
    assert s["idle_gaps_ms"] == pytest.approx(0.61)
    assert [(g["op"], g["gaps"]) for g in s["idle_gaps_by_launching_op"]] == [
        ("aten::add", 1), ("autograd::engine::evaluate_function: MyFunctionBackward", 1), ("MyFunction", 1)]
    assert [g["ms"] for g in s["idle_gaps_by_launching_op"]] == pytest.approx([0.24, 0.22, 0.15])
    assert "GPU idle gaps > 20 us: 0.6 ms" in format_summary([s])
    # one by one, longest first, with the ops enclosing each launch (outermost first)
    assert [(g["us"], g["after"], g["before"]) for g in s["longest_idle_gaps"]] == [
        (240, "k1", "k2"), (220, "k2", "k3"), (150, "k0", "k1")]
    assert s["longest_idle_gaps"][2]["chain"] == ["MyFunction", "aten::mm"]
    assert s["longest_idle_gaps"][1]["chain"] == ["autograd::engine::evaluate_function: MyFunctionBackward"]


@pytest.mark.parametrize("name,category", [
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4>>", "attention (flash)"),
    ("chunk_scaled_dot_kkt_fwd_kernel", "linear attention (fla/tilelang)"),
    ("prepare_wy_repr_bwd_kernel", "linear attention (fla/tilelang)"),
    ("kernel_kernel", "linear attention (fla/tilelang)"),
    ("tilelang_fused_chunk_gdr_fwd_kernel_kernel", "linear attention (fla/tilelang)"),
    ("_pre_gdr_bwd", "ours: fused triton"),
    ("_fused_mrope_fwd", "ours: fused triton"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>", "optimizer"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("some_unknown_thing", "other"),
])
def test_kernel_categories(name, category):
    assert categorize(name) == category


def test_profile_keys_are_validated():
    validate(load_config("configs/qwen35_vl_proxy.yaml", ["logging.profile_step=3", "logging.profile_num_steps=2"]))
    for bad in ("logging.profile_step=-1", "logging.profile_num_steps=0"):
        with pytest.raises(ConfigError, match="profile"):
            validate(load_config("configs/qwen35_vl_proxy.yaml", [bad]))


@pytest.mark.slow
def test_cpu_training_run_writes_trace_and_operator_table(tmp_path):
    from test_training import _train  # the entry point in a subprocess, like the other training tests

    # one short micro-batch a step: exporting the trace and building the operator table cost host
    # time per recorded op (the GDN reference records ops per token of each chunk), and nothing
    # checked here needs a larger step
    rows = _train(tmp_path, "train.iters=3", "train.seq_length=128", "train.global_batch_size=1",
                  "data.mock.max_image_side=64", "data.mock.max_text_tokens=48", "checkpoint.dir=null",
                  "logging.tensorboard=false", "logging.profile_step=2", "logging.profile_num_steps=1")
    assert sorted(rows) == [1, 2, 3]  # profiling does not stop or skip steps
    prof = tmp_path / "profile"
    with gzip.open(prof / "trace_rank0.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2"}  # only the requested step was recorded
    (summary,) = json.loads((prof / "kernels_rank0.json").read_text())
    ops = [o["op"] for o in summary["top_ops"]]
    assert any(op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear") for op in ops), ops
    assert 0 < sum(o["fraction"] for o in summary["top_ops"]) <= 1.0 + 1e-9
    assert "aten::" in (prof / "kernels_rank0.txt").read_text()


def test_kernels_belong_to_the_step_that_launched_them_and_the_warmup_step_is_not_summarized():
    """The host runs ahead: the warm-up step's kernel runs inside step 2's host span. It must not
    be charged to step 2, and step 2's device time starts when that kernel ends."""
    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 1,
                "args": {"correlation": corr}}

    def kernel(corr, ts, dur):
        return {**_kernel(f"k{corr}", ts, dur), "args": {"correlation": corr}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerWarmup#1", "ts": 0, "dur": 100},
        _step(2, 100, 100),
        launch(1, 50), launch(2, 110), launch(3, 150),
        kernel(1, 120, 100),   # the warm-up step's, running until 220
        kernel(2, 230, 50),    # step 2's: 10 us after the previous step's last kernel (normal spacing)
        kernel(3, 330, 20),    # 50 us idle before it: charged
    ]
    (s,) = summarize_trace(events)
    assert s["step"] == "ProfilerStep#2" and s["num_kernels"] == 2
    assert s["wall_ms"] == pytest.approx(0.130)       # 220 -> 350
    assert s["device_busy_ms"] == pytest.approx(0.070)
    assert s["idle_gaps_ms"] == pytest.approx(0.050)
    assert [(g["after"], g["before"]) for g in s["longest_idle_gaps"]] == [("k2", "k3")]


def test_profiler_traces_one_warmup_step_before_the_profiled_ones(tmp_path):
    from types import SimpleNamespace

    from multimodal.observability.profiling import StepProfiler

    cfg = SimpleNamespace(profile_step=3, profile_num_steps=1, profile_ranks=[0], dir=str(tmp_path),
                          profile_with_stack=False)
    prof = StepProfiler(cfg, rank=0, is_cuda=False)
    for it in (1, 2, 3, 4):
        prof.begin(it)
        if it == 2:
            assert prof.prof is not None  # started a step early
        torch.ones(8).sum()
        prof.end(it)
    assert prof.prof is None and prof.summary is not None  # finished after step 3
    trace = json.loads(gzip.open(tmp_path / "profile" / "trace_rank0.json.gz", "rt").read())["traceEvents"]
    names = {e["name"] for e in trace if str(e.get("name", "")).startswith(("ProfilerStep#", "ProfilerWarmup#"))}
    assert names == {"ProfilerWarmup#2", "ProfilerStep#3"}


def test_each_top_kernel_lists_the_code_that_launched_it():
    """Launch sites: the innermost Python frame outside torch, the top-level op and the innermost
    op around each launch, aggregated per kernel name (the backward thread has no Python frame)."""
    def span(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(corr, ts, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": corr}}

    def kernel(name, corr, ts, dur):
        return {**_kernel(name, ts, dur), "args": {"correlation": corr}}

    py = "python_function"
    events = [
        _step(1, 0, 1000),
        # thread 1: two hooks adding into main_grad, then a forward matmul under torch's module call
        span("megatron/core/distributed/ddp.py(380): hook", 10, 100, py), span("aten::add_", 20, 10),
        span("megatron/core/distributed/ddp.py(380): hook", 200, 100, py), span("aten::add_", 210, 10),
        span("model.py(5): forward", 400, 100, py), span("torch/nn/modules/linear.py(125): forward", 410, 80, py),
        span("aten::linear", 420, 50), span("aten::mm", 430, 20),
        # thread 2: autograd's backward node
        span("autograd::engine::evaluate_function: AddBackward0", 600, 50, tid=2), span("aten::add", 610, 20, tid=2),
        launch(1, 22), launch(2, 212), launch(3, 435), launch(4, 615, tid=2),
        kernel("add_kernel", 1, 30, 10), kernel("add_kernel", 2, 230, 10),
        kernel("gemm_kernel", 3, 440, 50), kernel("add_kernel", 4, 620, 30),
        kernel("orphan_kernel", 99, 700, 5),  # no launch record in the trace
    ]
    (s,) = summarize_trace(events)
    sites = {k["kernel"]: [(x["site"], x["calls"]) for x in k["sites"]] for k in s["top_kernels"]}
    assert sites["add_kernel"] == [("autograd::engine::evaluate_function: AddBackward0 | aten::add", 1),
                                   ("megatron/core/distributed/ddp.py(380): hook | aten::add_", 2)]
    assert sites["gemm_kernel"] == [("model.py(5): forward | aten::linear | aten::mm", 1)]
    assert sites["orphan_kernel"] == [("(launch not in trace)", 1)]
    assert "megatron/core/distributed/ddp.py(380): hook | aten::add_" in format_summary([s])
