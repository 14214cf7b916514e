"""The fast path: CuTeDSL kernels for sm_90a and sm_100a plus thin torch glue."""

FAST_MODULES: tuple[str, ...] = (
    "nmoe.fast.activation",
    "nmoe.fast.combine",
    "nmoe.fast.router",
    "nmoe.fast.dispatch",
    "nmoe.fast.gemm.sm90",
    "nmoe.fast.gemm.sm90_fp8",
    "nmoe.fast.gemm.sm100",
    "nmoe.fast.formats",
    "nmoe.fast.norm",
    "nmoe.fast.loss",
    "nmoe.fast.optim",
    "nmoe.fast.rope",
    "nmoe.fast.attention",
    "nmoe.fast.rdep",
)
