"""Kernels specific to sm_100a (Blackwell)."""
