"""Triton kernels of ReplaySSM (installed as sglang_replayssm.kernels)."""
