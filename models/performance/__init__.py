"""Model-level speed machinery: changes how fast a step runs, never what it computes.

- ``layer_graphs``: the decoder layers replayed as CUDA graphs (``train.cuda_graphs``).
- ``wgrad_fusion``: weight gradients added into megatron's fp32 ``main_grad`` inside the backward
  GEMM (``model.grad_accum_fusion``).
- ``main_grad_add``: grouped ``main_grad += grad`` adds, used by the graphs' backward.

Why here and not beside the trainer's patches (multimodal/performance/): these wrap model layers,
and a model package imports them (the vision encoder's graphs, models/qwen35_vl/vision_graphs.py,
reuse the decoder graphs' machinery); models/ may not import multimodal/ (tests/test_layering.py).
Graphs that only one architecture has stay in that architecture's folder.
"""
