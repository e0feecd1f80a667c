"""Multi-token prediction (model.mtp_num_layers): the shift within samples, the parameter names the
HF mapping uses, forward and loss against a reference written from vLLM's Qwen3_5MTP with
transformers' Qwen3.5 modules, packed vs unpacked, freezing, and a short proxy run."""

from __future__ import annotations

import pytest
import torch

from helpers.proxy_fixtures import ROW, proxy_model

from data.collate import pack_thd, pad_bshd
from data.mock import MockDataset
from models.common.mtp import shift_batch
from multimodal.forward_step import ForwardStep


def _samples(cfg, idx=(0, 1)):
    ds = MockDataset(cfg.model, cfg.data, 256)
    return [ds[i] for i in idx]


def _packed(cfg, samples, row=ROW, pad_multiple=1):
    m = cfg.model
    return pack_thd(samples, row, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size, pad_multiple)


def _run(cfg, model, batch, backward=False):
    """(LM loss sum, report) of one micro-batch through the trainer's ForwardStep and loss."""
    step = ForwardStep(torch.device("cpu"), torch.float32, image_token_id=cfg.model.vision_token_ids)
    out, loss_fn = step(iter([batch]), model)
    loss, _, report = loss_fn(out)
    if backward:
        loss.backward()
    return loss, report


def test_shift_stays_inside_each_sample():
    cu = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    tokens = torch.arange(10, 18)[None]
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": torch.ones(1, 8), "cu_seqlens_padded": cu}
    s = shift_batch(batch, 2, image_token_id=99)
    assert s["mtp_tokens"][0, 0].tolist() == [11, 12, 13, 0, 15, 16, 0, 0]
    assert s["mtp_loss_mask"][0, 0].tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    assert s["mtp_labels"][1, 0].tolist() == [112, 113, 0, 0, 116, 0, 0, 0]
    # BSHD: every row is a sample of its own
    s = shift_batch({"tokens": tokens.view(2, 4), "labels": tokens.view(2, 4), "loss_mask": torch.ones(2, 4)}, 1, 99)
    assert s["mtp_tokens"][0].tolist() == [[11, 12, 13, 0], [15, 16, 17, 0]]


def test_parameter_names_are_megatrons_mtp_names(mcore):
    cfg, model = proxy_model(["model.mtp_num_layers=1"])
    names = {n for n in model.state_dict() if ".mtp." in n and "_extra_state" not in n}
    layer = {n.split("decoder.layers.3.", 1)[1] for n in model.state_dict()
             if "decoder.layers.3." in n and "_extra_state" not in n}
    p = "language_model.mtp.layers.0."
    assert names == {p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight", p + "final_layernorm.weight"} | {
        p + "transformer_layer." + n for n in layer}
    h = cfg.model.hidden_size
    assert model.state_dict()[p + "eh_proj.weight"].shape == (h, 2 * h)
    assert {model.parameter_group(n) for n in names} == {"mtp"}
    # dist-checkpointing sees the same names (so training checkpoints hold the head)
    sharded = {k for k in model.sharded_state_dict() if ".mtp." in k and "_extra_state" not in k}
    assert sharded == names


def test_the_mtp_layer_keeps_its_number_on_a_later_pipeline_stage(mcore, monkeypatch):
    """On a stage whose decoder layers start at an offset (pipeline parallelism), the MTP layer is
    still layer 1: its MoE aux loss goes to the same tracker slot in every layout."""
    import megatron.core.transformer.transformer_layer as tl

    monkeypatch.setattr(tl, "get_transformer_layer_offset", lambda *a, **k: 7)
    _, model = proxy_model(["model.mtp_num_layers=1"], config="configs/qwen35_vl_proxy_moe.yaml")
    lm = model.language_model
    assert [layer.layer_number for layer in lm.decoder.layers][:2] == [8, 9]
    assert lm.mtp.layers[0].transformer_layer.layer_number == 1
    assert lm.mtp.layers[0].transformer_layer.mlp.router.layer_number == 1


def test_bad_mtp_configs_are_refused_in_one_line():
    from multimodal.config import ConfigError, load_config, validate

    for overrides, match in [
        (["model.mtp_num_layers=-1"], "mtp_num_layers must be >= 0"),
        (["model.mtp_loss_scale=-0.1"], "mtp_loss_scale must be >= 0"),
        (["model.freeze=[mtp]"], "drop mtp from model.freeze"),
        (["model.freeze=[vision,merger,language,embedding,lm_head]"], "nothing would train"),
    ]:
        cfg = load_config("configs/qwen35_vl_proxy.yaml", overrides)
        with pytest.raises(ConfigError, match=match):
            validate(cfg, world_size=2)


def _randomize_mtp_norms(model):
    """Non-zero (zero-centred) norm weights, so a 1+w vs w mix-up cannot hide."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".mtp." in n and p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def _hf_mtp_reference(cfg, model, depth: int = 0):
    """vLLM's Qwen3_5MultiTokenPredictor written with transformers' Qwen3.5 modules (RMSNorm,
    decoder layer, MRoPE), loaded from our MTP weights; -> callable(embeds, hidden, positions)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from models.qwen35_vl.hf import _attn_qkv_to_hf, hf_config_from_ours

    m = cfg.model
    text = Qwen3_5TextConfig(**hf_config_from_ours(m)["text_config"])
    text._attn_implementation = "sdpa"  # no mask given: causal
    p = f".mtp.layers.{depth}."
    sd = {n.split(p, 1)[1]: t for n, t in model.state_dict().items() if p in n}
    norms = {k: hf.Qwen3_5RMSNorm(m.hidden_size, eps=m.rms_norm_eps) for k in ("enorm", "hnorm", "final_layernorm")}
    for k, norm in norms.items():
        norm.weight.data.copy_(sd[f"{k}.weight"])
    layer = hf.Qwen3_5DecoderLayer(text, layer_idx=m.full_attention_interval - 1)  # a full-attention layer
    t = "transformer_layer."
    q, k, v = _attn_qkv_to_hf(sd[t + "self_attention.linear_qkv.weight"], m)
    gate, up = sd[t + "mlp.linear_fc1.weight"].chunk(2)
    layer.load_state_dict({
        "input_layernorm.weight": sd[t + "input_layernorm.weight"],
        "post_attention_layernorm.weight": sd[t + "pre_mlp_layernorm.weight"],
        "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": sd[t + "self_attention.linear_proj.weight"],
        "self_attn.q_norm.weight": sd[t + "self_attention.q_layernorm.weight"],
        "self_attn.k_norm.weight": sd[t + "self_attention.k_layernorm.weight"],
        "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": sd[t + "mlp.linear_fc2.weight"],
    })
    rotary = hf.Qwen3_5TextRotaryEmbedding(text)
    fc = sd["eh_proj.weight"]

    def run(embeds, hidden, positions):  # [n, H], [n, H], [3, n] -> MTP hidden [n, H]
        x = torch.cat([norms["enorm"](embeds), norms["hnorm"](hidden)], -1) @ fc.T  # embedding first
        cos_sin = rotary(x[None], positions[:, None])
        return norms["final_layernorm"](layer(x[None], position_embeddings=cos_sin)[0])

    return run


def _capture(model):
    """Hooks keeping the decoder's input (embeddings with image features) and output (after the
    final norm), both [S, B, H]."""
    seen = {}
    dec = model.language_model.decoder
    dec.register_forward_pre_hook(lambda mod, a, kw: seen.__setitem__("emb", kw["hidden_states"].detach()),
                                  with_kwargs=True)
    dec.register_forward_hook(lambda mod, a, out: seen.__setitem__("h0", out.detach()))
    return seen


@pytest.mark.parametrize("depth", [1, 2])
def test_forward_and_loss_match_a_reference_from_vllm(mcore, depth):
    cfg, model = proxy_model([f"model.mtp_num_layers={depth}"])
    _randomize_mtp_norms(model)
    seen = _capture(model)
    batch = _packed(cfg, _samples(cfg, (0, 1, 2)))
    loss, report = _run(cfg, model, batch)
    references = [_hf_mtp_reference(cfg, model, k) for k in range(depth)]
    emb = model.language_model.embedding.word_embeddings.weight  # tied: the LM head too
    cu = batch["cu_seqlens"].tolist()
    sums, counts = [0.0] * depth, [0.0] * depth
    with torch.no_grad():
        for a, b in zip(cu[:-2], cu[1:-1]):  # every sample (the last segment is the row's tail padding)
            h = seen["h0"][a:b, 0]
            for k in range(1, depth + 1):
                # depth k at t: embedding of token t+k, hidden of depth k-1 at t, MRoPE position of t;
                # predicts token t+k+1 (labels[t+k])
                h = references[k - 1](seen["emb"][a + k:b, 0], h[:b - a - k], batch["position_ids"][:, 0, a:b - k])
                ce = torch.nn.functional.cross_entropy(h @ emb.T, batch["labels"][0, a + k:b].clamp(min=0),
                                                       reduction="none")
                mask = batch["loss_mask"][0, a + k:b]
                sums[k - 1] += (ce * mask).sum()
                counts[k - 1] += mask.sum()
    assert min(counts) > 0 and int(report["mtp loss"][1]) == int(sum(counts))
    torch.testing.assert_close(report["mtp loss"][0], sum(sums), rtol=1e-5, atol=1e-5)
    # the LM loss sum gains scale/D x (LM tokens / depth-k tokens) x each depth's sum (megatron's
    # per-token form: one division by the LM token count gives scale x the mean MTP loss)
    lm = report["lm loss"]
    term = sum(cfg.model.mtp_loss_scale / depth * lm[1] / c * s for s, c in zip(sums, counts))
    torch.testing.assert_close(loss.detach() - lm[0], term, rtol=1e-5, atol=1e-5)


def test_freeze_mtp_and_lora_cover_the_head(mcore):
    from multimodal.freeze import freeze
    from multimodal.lora import apply_lora

    cfg, model = proxy_model(["model.mtp_num_layers=1"])
    counts = freeze(model, ["mtp"])
    assert counts["mtp"][0] == 0 and counts["mtp"][1] > 0 and counts["language"][0] == counts["language"][1]
    batch = _packed(cfg, _samples(cfg))
    _run(cfg, model, batch, backward=True)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None for n, g in grads.items() if ".mtp." in n)
    assert grads["language_model.decoder.layers.0.self_attention.in_proj.weight"].abs().sum() > 0

    cfg, model = proxy_model(["model.mtp_num_layers=1", "model.lora.rank=4"])
    apply_lora(model, cfg.model.lora, seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    mtp = [n for n in trainable if ".mtp." in n]
    decoder_attn = [n for n in trainable if "decoder.layers.3." in n]
    assert mtp and len(mtp) == len(decoder_attn)  # the same adapters as a full-attention decoder layer


def test_packed_and_unpacked_mtp_losses_are_equal(mcore):
    cfg, model = proxy_model(["model.mtp_num_layers=1"])
    _randomize_mtp_norms(model)
    m = cfg.model
    samples = _samples(cfg, (0, 1, 2))
    packed = _packed(cfg, samples)
    padded = pad_bshd(samples, 256, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size)
    _, rp = _run(cfg, model, packed)
    _, ru = _run(cfg, model, padded)
    assert int(rp["mtp loss"][1]) == int(ru["mtp loss"][1]) > 0
    torch.testing.assert_close(rp["mtp loss"], ru["mtp loss"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rp["lm loss"], ru["lm loss"], rtol=1e-5, atol=1e-4)


def test_sparse_lm_head_runs_the_mtp_depths_at_their_loss_tokens(mcore, monkeypatch):
    """model.sparse_lm_head covers the MTP depths: on a packed batch each depth's pass through the
    shared head runs at its own (shifted) loss tokens. LM and MTP losses and every gradient equal
    the dense head's; the FLOPs count the tokens each depth's head ran on."""
    import fused_kernels.fused_linear_ce as lce
    from models import get_model_family
    from models.qwen35_vl.flops import _mtp_parts, training_flops

    head_rows = []  # the rows each pass through the LM head computed logits for
    real_head = lce.vocab_parallel_linear_cross_entropy

    def counting_head(hidden, *a, token_index=None, **kw):
        head_rows.append(hidden.shape[0] * hidden.shape[1] if token_index is None else len(token_index))
        return real_head(hidden, *a, token_index=token_index, **kw)

    monkeypatch.setattr(lce, "vocab_parallel_linear_cross_entropy", counting_head)

    cfg, model = proxy_model(["model.mtp_num_layers=2"])
    _randomize_mtp_norms(model)
    m = cfg.model
    batch = _packed(cfg, _samples(cfg, (0, 1, 2)))
    runs = {}
    for sparse in (False, True):
        model.zero_grad(set_to_none=True)
        head_rows.clear()
        step = ForwardStep(torch.device("cpu"), torch.float32, image_token_id=m.vision_token_ids, sparse_lm_head=sparse,
                           row_extras=get_model_family(m.name).packed_row_extras)
        out, loss_fn = step(iter([batch]), model)
        loss, _, report = loss_fn(out)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[sparse] = (report, grads, step.batches[0])
        rows = list(head_rows)
    (dense_report, dense_grads, dense_rec), (sparse_report, sparse_grads, sparse_rec) = runs[False], runs[True]
    for key in ("lm loss", "mtp loss"):
        torch.testing.assert_close(sparse_report[key], dense_report[key], rtol=1e-6, atol=1e-5)
    assert set(sparse_grads) == set(dense_grads) and any(".mtp." in n for n in dense_grads)
    floor = 1e-3 * max(g.norm().item() for g in dense_grads.values())
    for name, g in dense_grads.items():
        assert (sparse_grads[name] - g).norm().item() / max(g.norm().item(), floor) < 1e-4, name
    shifted = shift_batch(batch, 2, m.vision_token_ids)
    head_tokens = int((shifted["mtp_loss_mask"] != 0).sum())
    real = int(batch["num_real_tokens"])
    assert dense_rec["mtp_head_tokens"] is None and sparse_rec["mtp_head_tokens"] == head_tokens < 2 * real
    assert int(sparse_report["mtp loss"][1]) == head_tokens  # the tokens the MTP loss averages over
    # the LM pass, then depths 1 and 2: each at its own loss tokens only
    depth_tokens = [int((d != 0).sum()) for d in shifted["mtp_loss_mask"]]
    assert rows == [sparse_rec["lm_head_tokens"], *depth_tokens]
    lengths, loss_tokens = batch["sample_lengths"], sparse_rec["lm_head_tokens"]
    _, head, _ = _mtp_parts(m)
    saved = (training_flops(m, lengths, [], loss_tokens) - training_flops(m, lengths, [], loss_tokens, head_tokens))
    assert saved == pytest.approx(3 * head * (2 * sum(lengths) - head_tokens))


def test_dry_run_counts_the_mtp_parameters(mcore):
    from models.qwen35_vl.param_counts import stage_params

    for overrides in (["model.mtp_num_layers=1"], ["model.mtp_num_layers=2"]):
        cfg, model = proxy_model(overrides)
        assert stage_params(cfg.model).parts["mtp"] == sum(p.numel() for n, p in model.named_parameters()
                                                           if ".mtp." in n)
    cfg, model = proxy_model(["model.mtp_num_layers=1"], config="configs/qwen35_vl_proxy_moe.yaml")
    assert stage_params(cfg.model).parts["mtp"] == sum(p.numel() for n, p in model.named_parameters() if ".mtp." in n)


def test_moe_proxy_trains_its_mtp_layer(mcore):
    cfg, model = proxy_model(["model.mtp_num_layers=1"], config="configs/qwen35_vl_proxy_moe.yaml")
    loss, report = _run(cfg, model, _packed(cfg, _samples(cfg)), backward=True)
    assert torch.isfinite(loss) and report["mtp loss"][1] > 0
    grads = {n: p.grad for n, p in model.named_parameters() if ".mtp." in n}
    for part in ("eh_proj", "mlp.router", "mlp.experts", "mlp.shared_experts", "self_attention.linear_qkv"):
        assert any(part in n and g is not None and g.abs().sum() > 0 for n, g in grads.items()), part


@pytest.mark.slow
def test_proxy_run_logs_a_falling_mtp_loss(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy.yaml",
           f"logging.dir={tmp_path}", "logging.progress_bar=false", "logging.tensorboard=true",
           "checkpoint.dir=null", "model.mtp_num_layers=1", "train.iters=8", "train.seq_length=256",
           "train.global_batch_size=1",
           "data.mock.max_image_side=64", "data.mock.max_text_tokens=48"]
    proc = subprocess.run(cmd, cwd=root, env={**env, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mtp = [r["mtp_loss"] for r in rows]
    assert len(mtp) == 8 and mtp[-1] < mtp[0] - 0.5, mtp
    assert "mtp_loss" in proc.stderr + proc.stdout  # the console line
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("mtp_loss")) == 8


def test_flops_count_the_mtp_matmuls_torch_counts(mcore):
    """Forward matmul FLOPs the MTP head adds, as torch's FlopCounterMode measures them, equal the
    per-token counts of models/qwen35_vl/flops.py (eh_proj, the attention layer's projections, its
    MLP, the LM-head pass) times the positions it ran on."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.qwen35_vl.flops import _mtp_parts, training_flops

    cfg, model = proxy_model(["model.mtp_num_layers=1"])
    batch = _packed(cfg, _samples(cfg))

    def matmul_flops(with_mtp: bool) -> int:
        lm = model.language_model  # the head and the depth every stage reads, off together
        mtp, depth = lm.mtp, lm.mtp_num_layers
        lm.mtp, lm.mtp_num_layers = (mtp, depth) if with_mtp else (None, 0)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            _run(cfg, model, batch)
        lm.mtp, lm.mtp_num_layers = mtp, depth
        ops = counter.get_flop_counts()["Global"]
        return sum(v for op, v in ops.items() if "mm" in str(op))

    weights, head, _ = _mtp_parts(cfg.model)
    assert matmul_flops(True) - matmul_flops(False) == (weights + head) * ROW
    base = cfg.model.__class__(**{**vars(cfg.model), "mtp_num_layers": 0})
    lengths = batch["sample_lengths"]
    assert training_flops(cfg.model, lengths, []) > training_flops(base, lengths, []) + 3 * (weights + head) * sum(lengths)


def test_mtp_depth_follows_the_hf_checkpoint_unless_set(tmp_path):
    """model.mtp_num_layers left unset is the checkpoint's mtp_num_hidden_layers in every layout
    (pipeline stages pass the MTP inputs on; the MoE overlap plan runs the head in its post-process
    node); 0 turns it off."""
    import json

    from helpers.hf_fixtures import add_mtp_head, make_hf_checkpoint
    from multimodal.config import load_config, resolve_sources

    hf_dir = make_hf_checkpoint(tmp_path / "hf", layers=4)
    add_mtp_head(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    depth = {}
    for heads in (1, 0):
        raw["text_config"]["mtp_num_hidden_layers"] = heads
        (hf_dir / "config.json").write_text(json.dumps(raw))
        for name, extra in [("unset", []), ("off", ["model.mtp_num_layers=0"]), ("pp2", ["parallel.pp=2"]),
                            ("overlap", ["parallel.moe_a2a_overlap=true"])]:
            cfg = load_config("configs/qwen35_vl_proxy.yaml", [f"model.hf_config={hf_dir}", *extra])
            depth[name, heads] = resolve_sources(cfg).model.mtp_num_layers
    assert depth == {("unset", 1): 1, ("off", 1): 0, ("pp2", 1): 1, ("overlap", 1): 1,
                     ("unset", 0): 0, ("off", 0): 0, ("pp2", 0): 0, ("overlap", 0): 0}


def test_dry_run_counts_the_mtp_embeddings_a_pipeline_stage_receives():
    """Under pp=2 the MTP input embeddings travel with the hidden states; the last stage keeps the
    tensor it received for each micro-batch in flight: one [S, B, H] block more per depth, beside
    the MTP layers' own activations. The first stage's activations do not change."""
    from models import get_model_family
    from multimodal.config import load_config, resolve_sources
    from multimodal.dry_run import BF16, GIB, check_layout, rank_params, stage_memory

    acts = {}
    for depth in (0, 2):
        cfg = resolve_sources(load_config("configs/qwen35_vl_proxy.yaml", [
            f"model.mtp_num_layers={depth}", "parallel.pp=2", "train.global_batch_size=8"]))
        lay, _ = check_layout(cfg, 2)
        acts[depth] = [stage_memory(cfg, lay, rank_params(cfg.model, lay, s)).activations for s in (0, 1)]
    t, h = cfg.train, cfg.model.hidden_size
    tokens, held = t.micro_batch_size * t.seq_length, lay.in_flight(1)
    per_token = get_model_family(cfg.model.name).activation_bytes_per_token(cfg.model, lay)["mtp"]
    received = 2 * held * tokens * h * BF16 / GIB
    layers = 2 * held * tokens * per_token / GIB
    assert acts[2][0] == acts[0][0]
    assert acts[2][1] - acts[0][1] == pytest.approx(received + layers, rel=1e-9)
