"""Numerical parity of our model against transformers' Qwen3.5(-MoE) on the same checkpoint.

Both models load the same Hugging Face directory, run the same text with several images of
different sizes (so the vision tower, the embedding scatter and MRoPE's 3-D positions are
all exercised), and we compare logits, the masked LM loss, every parameter's gradient (mapped
to HF names) and the MRoPE position ids. Requires torch.distributed + megatron's
model-parallel state to be initialised (world size 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.common.vision_patches import patchify
from models.qwen35_vl.hf import hf_to_ours, load_hf_state_dict, model_config_from_hf, ours_to_hf
from models.qwen35_vl.mrope import mrope_position_ids
from models.common.parallel_config import ParallelConfig

THRESHOLDS = {"fp32": {"logits": 1e-4, "loss": 1e-5, "grad": 1e-3},
              "bf16": {"logits": 1e-1, "loss": 1e-2, "grad": 1e-1}}


def build_from_hf(hf_dir, dtype: torch.dtype, parallel: ParallelConfig | None = None):
    """Our model with the checkpoint's weights (TP=1 layout), and its model config."""
    from models.qwen35_vl.model import build

    m = model_config_from_hf(hf_dir)
    m.attention_backend, m.gdn_backend = "sdpa", "torch"
    m.moe_aux_loss_coeff = 0.0  # transformers adds no load-balancing loss unless asked; neither do we here
    model = build(m, parallel or ParallelConfig(), dtype)
    load_full_state_dict(model, hf_to_ours(load_hf_state_dict(hf_dir), m))
    return model, m


def load_full_state_dict(model, state: dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, t in state.items():
        if own[k].shape != t.shape:
            raise ValueError(f"{k}: checkpoint shape {tuple(t.shape)} != model shape {tuple(own[k].shape)}")
    model.load_state_dict(state, strict=False)


def parity_inputs(m, seed: int, image_sides=((64, 96), (32, 32), (96, 64))):
    """One sample: text, then images of different sizes separated by text; labels on the tail."""
    g = torch.Generator().manual_seed(seed)
    v = m.vision
    lowest_special = min(m.image_token_id, m.vision_start_token_id, m.vision_end_token_id)
    text = lambda n: torch.randint(0, min(lowest_special, m.vocab_size), (n,), generator=g).tolist()  # noqa: E731
    ids, pixels, grids = text(5), [], []
    for h, w in image_sides:
        pv, thw = patchify(torch.rand(3, h, w, generator=g), v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        pixels.append(pv)
        grids.append(thw)
        n = int(thw.prod()) // v.spatial_merge_size**2
        ids += [m.vision_start_token_id] + [m.image_token_id] * n + [m.vision_end_token_id] + text(4)
    ids += text(12)
    input_ids = torch.tensor([ids])
    labels = input_ids.clone()
    labels[:, : len(ids) // 2] = -100  # supervise the second half only
    grid = torch.stack(grids)
    return input_ids, torch.cat(pixels), grid, labels


def _our_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shifted = labels[:, 1:]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


# transformers resolves these to flash-linear-attention's Triton kernels whenever ``fla`` imports,
# even on a machine without a GPU; the reference must then use its own PyTorch versions.
_HF_FLA_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                     "causal_conv1d_fn", "causal_conv1d_update")


# transformers' modules of Qwen3.5 and Qwen3.5-MoE (bench_train swaps their GDN kernels too)
HF_MODELING_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
                       "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def use_hf_torch_kernels() -> None:
    import importlib

    for name in HF_MODELING_MODULES:
        mod = importlib.import_module(name)
        for fn in _HF_FLA_FUNCTIONS:
            wrapped = getattr(mod, fn, None)
            if wrapped is not None and hasattr(wrapped, "__wrapped__"):
                setattr(mod, fn, wrapped.__wrapped__)


def run_parity(hf_dir, dtype: str = "fp32", seed: int = 0) -> dict:
    from transformers import AutoModelForImageTextToText

    if not torch.cuda.is_available():
        use_hf_torch_kernels()

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    from core.seeding import seed_everything

    seed_everything(seed)
    ours, m = build_from_hf(hf_dir, torch_dtype)
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch_dtype, attn_implementation="sdpa")
    hf.train()
    ours.train()
    input_ids, pixel_values, grid, labels = parity_inputs(m, seed)
    mm_types = (input_ids == m.image_token_id).int()

    # position ids: ours (host, per sample) vs transformers' get_rope_index
    pos = mrope_position_ids(input_ids[0], grid, m.image_token_id, m.vision.spatial_merge_size)
    hf_pos, _ = hf.model.get_rope_index(input_ids, mm_types, image_grid_thw=grid)
    pos_equal = bool(torch.equal(pos, hf_pos[:, 0]))

    out = hf(input_ids=input_ids, pixel_values=pixel_values.to(torch_dtype), image_grid_thw=grid,
             mm_token_type_ids=mm_types, labels=labels)
    out.loss.backward()
    logits = ours(input_ids, pos[:, None], pixel_values=pixel_values.to(torch_dtype), image_grid_thw=grid)
    loss = _our_loss(logits, labels)
    loss.backward()

    hf_grads: dict[str, torch.Tensor] = {}
    for name, p in hf.named_parameters():
        if p.grad is not None:
            hf_grads.update(_on_disk(name, p.grad))
    our_grads = ours_to_hf({n: p.grad for n, p in ours.named_parameters() if p.grad is not None}, m)
    missing = sorted(set(hf_grads) - set(our_grads))
    if missing:
        raise KeyError(f"no gradient of ours maps to HF {missing[:5]}")
    # Relative to each gradient's norm, floored at 1e-3 of the largest: a parameter whose
    # gradient is ~1e-7 (A_log far from the loss) would otherwise report pure fp32 rounding.
    norms = {k: g.float().norm().item() for k, g in hf_grads.items()}
    floor = 1e-3 * max(norms.values())
    rels = {k: (our_grads[k].float() - g.float()).norm().item() / max(norms[k], floor, 1e-30)
            for k, g in hf_grads.items()}
    worst = max(rels, key=rels.get)
    rel = rels[worst]
    result = {
        "max_abs_logit_diff": (logits.float() - out.logits.float()).abs().max().item(),
        "loss_abs_diff": abs(loss.item() - out.loss.item()),
        "max_rel_grad_diff": rel,
        "worst_grad": worst,
        "worst_grad_norm": norms[worst],
        "num_params_compared": len(hf_grads),
        "position_ids_equal": pos_equal,
        "loss": loss.item(),
        "dtype": dtype,
    }
    t = THRESHOLDS[dtype]
    result["ok"] = (pos_equal and result["max_abs_logit_diff"] <= t["logits"]
                    and result["loss_abs_diff"] <= t["loss"] and rel <= t["grad"])
    return result


def _on_disk(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers keeps MoE experts fused in memory (gate_up_proj [E, 2F, H], down_proj [E, H, F]);
    split them into the per-expert on-disk names our mapping uses."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        out = {}
        for e in range(t.shape[0]):
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = t[e].chunk(2)
        return out
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    return {name: t}
