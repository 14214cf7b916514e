"""The step breakdown's grouping: kernel names as the profiler reports them land in the right op family."""

from __future__ import annotations

import pytest

from bench.stepprofile import PHASES, breakdown, categorize


@pytest.mark.parametrize(("kernel", "family"), [
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_0", "attention"),
    ("kernel_cutlass_grouped_gemm_kernel_nmoefastkernelssm90grouped_gemm_0", "expert_gemm"),
    ("kernel_cutlass_grouped_wgrad_kernel_0", "expert_gemm"),
    ("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "dense_gemm"),
    ("kernel_cutlass_adamw_kernel_0", "adamw"),
    ("kernel_cutlass_ce_fwd_kernel_0", "cross_entropy_rows"),
    ("kernel_cutlass_combine_gather_fwd_kernel_0", "dispatch_combine"),
    ("kernel_cutlass_mla_kv_grad_kernel_ptrbf16gmemalign16_0", "mla_assembly"),
    ("kernel_cutlass_embed_bwd_kernel_ptrbf16gmemalign16_0", "embedding"),
    ("kernel_cutlass_spread_rows_kernel_ptri32gmemalign16_0", "dispatch_combine"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "copy_cast_elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<LpMaxFunctor>", "norms_reductions"),
    ("Memcpy DtoD (Device -> Device)", "copy_cast_elementwise"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_names_fall_in_their_family(kernel: str, family: str) -> None:
    assert categorize(kernel) == family


def test_breakdown_sums_shares_and_busy_time() -> None:
    kernels = [("nvjet_a", 3.0), ("nvjet_a", 1.0), ("flash_fwd", 2.0), ("mystery", 2.0)]
    got = breakdown(kernels, {"forward": 5.0, "backward": 3.0}, step_ms=10.0, top=2)
    assert got["kernel_ms"] == 8.0 and got["busy"] == 0.8
    assert got["categories"]["dense_gemm"] == {"ms": 4.0, "launches": 2, "share": 0.5}
    assert next(iter(got["categories"])) == "dense_gemm"
    assert got["phases_ms"] == {p: {"forward": 5.0, "backward": 3.0}.get(p, 0.0) for p in PHASES}
    assert [k["name"] for k in got["top_kernels"]] == ["nvjet_a", "flash_fwd"]


def test_breakdown_over_several_calls_is_per_call() -> None:
    """Two replays of a step profiled together: every time and launch count is one step's, not their sum."""
    kernels = [("nvjet_a", 3.0), ("flash_fwd", 1.0), ("nvjet_a", 5.0), ("flash_fwd", 1.0)]
    got = breakdown(kernels, {"forward": 4.0}, step_ms=12.0, calls=2)
    assert (got["calls"], got["kernel_ms"], got["step_ms"], got["busy"]) == (2, 5.0, 6.0, 5.0 / 6.0)
    assert got["categories"]["dense_gemm"] == {"ms": 4.0, "launches": 1, "share": 0.8}
    assert got["top_kernels"][0] == {"name": "nvjet_a", "category": "dense_gemm", "ms": 4.0, "launches": 1}
    assert got["phases_ms"]["forward"] == 2.0


def test_kernel_times_leave_out_annotation_spans() -> None:
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.stepprofile import kernel_times

    def event(name: str, device: DeviceType, us: float, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event("nvjet_a", DeviceType.CUDA, 3000.0), event("aten::mm", DeviceType.CPU, 9000.0),
              event("Optimizer.step#AdamW.step", DeviceType.CUDA, 28000.0, annotation=True),
              event("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 500.0)]
    assert kernel_times(events) == [("nvjet_a", 3.0), ("Memcpy DtoD (Device -> Device)", 0.5)]


def test_small_kernels_are_traced_to_their_op_and_caller() -> None:
    """A cast in a model line and an add in an autograd node: each kernel is charged to its op and caller,
    and a GEMM (not a small family) is left out."""
    from types import SimpleNamespace

    from bench.stepprofile import launch_records, op_rows

    def kern(name: str, us: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, duration=us)

    node = SimpleNamespace(name="autograd::engine::evaluate_function: AddBackward0", stack=[],
                           cpu_parent=None)
    fwd = SimpleNamespace(name="aten::to", stack=["torch/nn/x.py(1): f", "nmoe/fast/moe.py(99): moe_layer"],
                          cpu_parent=None)
    events = [
        SimpleNamespace(name="aten::copy_", input_shapes=[[4, 8]], stack=[], cpu_parent=fwd,
                        kernels=[kern("void at::native::bfloat16_copy_kernel_cuda", 500.0)]),
        SimpleNamespace(name="aten::add", input_shapes=[[4, 8], [4, 8]], stack=[], cpu_parent=node,
                        kernels=[kern("vectorized_elementwise_kernel<CUDAFunctor_add>", 250.0)] * 2),
        SimpleNamespace(name="aten::mm", input_shapes=[[4, 8], [8, 8]], stack=[], cpu_parent=fwd,
                        kernels=[kern("nvjet_sm90_tst_256x128", 9000.0)]),
    ]
    recs = launch_records(events)
    assert recs == [("aten::copy_", "[[4, 8]]", "nmoe/fast/moe.py(99): moe_layer", 0.5),
                    ("aten::add", "[[4, 8], [4, 8]]", "AddBackward0", 0.25),
                    ("aten::add", "[[4, 8], [4, 8]]", "AddBackward0", 0.25)]
    rows = op_rows(recs)
    assert [(r["op"], r["ms"], r["launches"]) for r in rows] == [("aten::copy_", 0.5, 1),
                                                                 ("aten::add", 0.5, 2)]


def test_one_microbatch_is_moonlet_at_the_batch_with_one_microbatch() -> None:
    """The benches' step config: moonlet at the asked batch, grad_accum 1, further overrides applied."""
    from bench.stepprofile import one_microbatch

    cfg = one_microbatch(3, "--train.param_dtype=fp32")
    assert (cfg.data.batch_size, cfg.train.grad_accum, cfg.train.param_dtype) == (3, 1, "fp32")
    assert cfg.model.n_routed_experts == 64
