"""Kernels specific to sm_90a (Hopper)."""
