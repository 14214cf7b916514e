"""CuTeDSL kernels."""
