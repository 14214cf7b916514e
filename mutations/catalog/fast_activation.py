"""relu2.fast_*: defects in the CuTeDSL relu2 kernels (nmoe/fast/kernels/activation.py); GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/activation.py"
PRIMS = "nmoe/fast/kernels/prims.py"
TESTS = "tests/test_fast_activation.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "relu2.fast_square_dropped", FILE,
        "    sq: cute.TensorSSA = r * r\n",
        "    sq: cute.TensorSSA = r\n",
        "fast relu2 forward kernel stores relu(x) without squaring", TESTS, ("relu2",), device="gpu",
    ),
    sep_mutation(
        "relu2.fast_nan_to_zero", FILE,
        "    r: cute.TensorSSA = cute.where(x <= zero, zero, x)",
        "    r: cute.TensorSSA = cute.where(x > zero, x, zero)",
        "fast relu maps NaN to 0 (PTX max.f32 semantics) instead of propagating it, fwd and bwd", TESTS,
        ("relu2",), device="gpu",
    ),
    sep_mutation(
        "relu2.fast_tail_dropped", PRIMS,
        "        if base + j < n:\n            mb[base + j] = frag[j]",
        "        if base + j < base:\n            mb[base + j] = frag[j]",
        "the ragged tail (last n % vec elements) is never stored (store_tail, shared by relu2's kernels and "
        "ce_scale)", TESTS, ("relu2",),
        device="gpu",
    ),
    sep_mutation(
        "relu2.fast_nan_bits_canonical", PRIMS,
        "cute.where(v != v, cute.full_like(rounded, BF16_CANONICAL_NAN), rounded)",
        "rounded",
        "bf16 NaN left with the GPU cvt's bits 0x7FFF instead of the spec's canonical NaN (in the shared "
        "out_bits, so every bf16-writing kernel)", TESTS,
        ("relu2",), device="gpu",
    ),
    sep_mutation(
        "relu2.fast_bwd_factor_dropped", FILE,
        "    two_r = 2.0 * _relu(x.to(Float32))",
        "    two_r = _relu(x.to(Float32))",
        "fast relu2 backward computes dy * relu(x), dropping the factor 2", TESTS, ("relu2",), device="gpu",
    ),
)
