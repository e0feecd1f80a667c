"""The shared core: small modules that import nothing of the project, so every layer above
(fused_kernels, models, data, the trainer) may use them. See tests/test_layering.py for the rule."""
