"""mxfp8/nvfp4 .fast_*: defects in the CuTeDSL quantizer kernels (nmoe/fast/kernels/formats.py); GPU only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/formats.py"
TESTS = "tests/test_fast_formats.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "mxfp8.fast_scale_ceil_dropped", FILE,
        " + sel((amax & 0x7FFFFF) > F32_MANT_1_75, 1, 0)", "",
        "scale byte takes floor(log2 s) instead of ceil", TESTS, ("quantize_mxfp8_32",), device="gpu",
    ),
    sep_mutation(
        "mxfp8.fast_zero_block_keeps_sign", FILE,
        "out[q] = sel(amax == 0, 0, word)", "out[q] = word",
        "an all-zero block keeps -0.0 codes instead of 0x00", TESTS, ("quantize_mxfp8_32",), device="gpu",
    ),
    sep_mutation(
        "mxfp8.fast_inf_not_clamped", FILE,
        "a = f2i(cute.arch.fmin(Float32(cute.math.absf(v)), E4M3_MAX))",
        "a = f2i(Float32(cute.math.absf(v)))",
        "no clamp to 448 before the e4m3 narrowing", TESTS, ("quantize_mxfp8_32",), device="gpu",
    ),
    sep_mutation(
        "nvfp4.fast_scale_round_up", FILE,
        "e4m3_mag(f2i(s_real))", "e4m3_mag(f2i(s_real) + 0xFFFFF)",
        "block scale rounded up instead of to nearest even", TESTS, ("quantize_nvfp4",), device="gpu",
    ),
    sep_mutation(
        "nvfp4.fast_reciprocal_multiply", FILE,
        "div_rn(xf[j], safe)", "mul_rn(xf[j], div_rn(1.0, safe))",
        "x/(s_b*g) computed as x*(1/(s_b*g)): one more rounding than the spec", TESTS, ("quantize_nvfp4",),
        device="gpu",
    ),
    sep_mutation(
        "nvfp4.fast_amax_includes_nonfinite", FILE,
        "sel(a < F32_INF, a, 0)", "a",
        "tensor amax lets Inf/NaN in, so every scale collapses", TESTS, ("quantize_nvfp4",), device="gpu",
    ),
    sep_mutation(
        "nvfp4.fast_nan_block_scale_not_7f", FILE,
        "sel(bad == 0, s_code, 0x7F)", "s_code",
        "a block holding NaN/Inf gets a finite scale instead of e4m3 NaN", TESTS, ("quantize_nvfp4",),
        device="gpu",
    ),
    sep_mutation(
        "mxfp8_weight.fast_one_warp_amax", FILE,
        "        amax = cutlass_max(amax, red[w])\n", "        amax = cutlass_max(amax, red[tidx // 32])\n",
        "each warp of the 128x128 weight quantizer scales its rows by its own max, not the block's",
        TESTS, ("quantize_mxfp8_w128",), device="gpu",
    ),
    sep_mutation(
        "mxfp8.fast_dequant_nan_scale_ignored", FILE,
        " | (b == 255) | ", " | ",
        "dequantize reads scale byte 255 as the exponent 2^128 (Inf) instead of NaN", TESTS,
        ("dequantize_mxfp8_32", "dequantize_mxfp8_w128"), device="gpu",
    ),
    sep_mutation(
        "nvfp4.fast_dequant_zero_times_inf", FILE,
        "nan = ((s & 0x7F) == 0x7F) | (ga > F32_INF) | ((r & 0x7FFFFFFF) > F32_INF)",
        "nan = ((s & 0x7F) == 0x7F) | (ga > F32_INF)",
        "NVFP4 dequantize lets the GPU's 0 * Inf bits (0x7FFFFFFF) out instead of the canonical NaN", TESTS,
        ("dequantize_nvfp4",), device="gpu",
    ),
)
