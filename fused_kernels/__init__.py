"""Kernels, each beside its plain PyTorch reference."""
