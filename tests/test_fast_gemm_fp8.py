"""nmoe.fast.gemm.sm90_fp8 (sm_90a fp8 grouped GEMM fwd): PTX compile checks and refusals on CPU; on GPU the
FP8_SM90 contract of parity/registry.py against a float64 oracle decoded here with ml_dtypes: |fast - ref64|
<= 1 ulp(bf16) + 2 (min(K, 128) 2^-14 + ceil(K/128) 2^-24) (|A| |B|), NaN exactly where ref64 is NaN."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from fastcompile import assemble, assert_rows_ok, compile_rows
from test_fast_gemm import child_env, cumsum, ends_to_ranges, ulp_bf16, uniform_counts, zipf_counts
from torch import Tensor

from nmoe.fast import gemm, op, runtime
from nmoe.fast.arch import ArchError
from nmoe.fast.gemm import sm90_fp8 as gemm_fp8
from nmoe.fast.gemm.routing import require
from nmoe.fast.gemm.sm90_fp8 import KERNELS, grouped_gemm_fp8
from nmoe.fast.limits import GEMM_MAX_GROUPS
from parity.registry import FP8_SM90

ROOT = Path(__file__).resolve().parents[1]
BLK = 128
DEV = torch.device("cuda")
gpu = pytest.mark.gpu

# ---------------------------------------------------------------------------------------------------------
# Oracle: e4m3 codes and e8m0 scales decoded independently of nmoe; per-block float64 products.
# ---------------------------------------------------------------------------------------------------------


def e4m3_f64(codes: Tensor) -> Tensor:
    return torch.from_numpy(codes.cpu().numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64))


def e8m0_f64(b: Tensor) -> Tensor:
    v = torch.exp2(b.cpu().double() - 127)
    return torch.where(b.cpu() == 255, torch.nan, v)


class Case:
    """Operands on the GPU plus their float64 decodings: x codes [M, K], x scales [M, K/128], w codes
    [E, N, K], w scales [E, N/128, K/128], group ends."""

    def __init__(self, xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, ends: Sequence[int]) -> None:
        self.xq, self.xs, self.wq, self.ws = (t.to(DEV) for t in (xq, xs, wq, ws))
        self.ends = list(ends)
        self.m, self.k = xq.shape
        self.n = wq.shape[1]
        self.xv, self.wv = e4m3_f64(xq).to(DEV), e4m3_f64(wq).to(DEV)
        self.sx, self.sw = e8m0_f64(xs).to(DEV), e8m0_f64(ws).to(DEV)

    def offs(self) -> Tensor:
        return torch.tensor(self.ends, dtype=torch.int32, device=DEV)

    def run(self) -> Tensor:
        return grouped_gemm_fp8(self.xq, self.xs, self.wq, self.ws, self.offs())

    def blocks(self, absolute: bool = False) -> Tensor:
        """P[kt, r, c] = sum over K block kt of x code values times w[e(r)] code values (no scales)."""
        kb = self.k // BLK
        p = torch.zeros(kb, self.m, self.n, dtype=torch.float64, device=DEV)
        xv, wv = (self.xv.abs(), self.wv.abs()) if absolute else (self.xv, self.wv)
        for e, (s, t) in enumerate(ends_to_ranges(self.ends)):
            if t > s:
                xb = xv[s:t].reshape(t - s, kb, BLK).transpose(0, 1)
                wb = wv[e].reshape(self.n, kb, BLK).permute(1, 2, 0)
                p[:, s:t] = xb @ wb
        return p

    def w_scale(self, n_block: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """S_w[kt, r, c] = w scale of row r's expert at column c's N block (or n_block(c)) and K block kt."""
        kb = self.k // BLK
        cols = torch.arange(self.n, device=DEV) // BLK
        cols = cols if n_block is None else n_block(cols)
        out = torch.zeros(kb, self.m, self.n, dtype=torch.float64, device=DEV)
        for e, (s, t) in enumerate(ends_to_ranges(self.ends)):
            out[:, s:t] = self.sw[e][cols].t()[:, None, :]
        return out

    def x_scale(self) -> Tensor:
        return self.sx.t()[:, :, None].expand(-1, -1, self.n)

    def formula(self, sx: Tensor | None = None, sw: Tensor | None = None, p: Tensor | None = None) -> Tensor:
        """sum_kt P_kt * S_x * S_w in float64, with any of the three replaced to model a defect."""
        p = self.blocks() if p is None else p
        sx = self.x_scale() if sx is None else sx
        sw = self.w_scale() if sw is None else sw
        return (p * sx * sw).sum(0) if p.shape[0] else torch.zeros(self.m, self.n, device=DEV).double()

    def ref(self) -> tuple[Tensor, Tensor]:
        """ref64 and |A| |B|, both from the dequantized operands (rows past the last end are 0)."""
        x = self.xv * self.sx.repeat_interleave(BLK, 1)
        w = self.wv * self.sw.repeat_interleave(BLK, 1).repeat_interleave(BLK, 2)
        ref = torch.zeros(self.m, self.n, dtype=torch.float64, device=DEV)
        mag = torch.zeros_like(ref)
        for e, (s, t) in enumerate(ends_to_ranges(self.ends)):
            if t > s:
                ref[s:t] = x[s:t] @ w[e].t()
                mag[s:t] = x[s:t].abs() @ w[e].abs().t()
        return ref, mag


def excess(out: Tensor, ref: Tensor, mag: Tensor, k: int) -> Tensor:
    """Elementwise |out - ref| / allowed under FP8_SM90 (finite ref only); a NaN out counts as a violation."""
    allowed = FP8_SM90.n * ulp_bf16(ref) + FP8_SM90.c * float(FP8_SM90.acc(k)) * mag
    return torch.nan_to_num((out.double() - ref).abs() / allowed, nan=float("inf"))


def violates(candidate: Tensor, ref: Tensor, mag: Tensor, k: int) -> bool:
    finite = ~ref.isnan()
    if not torch.equal(candidate.isnan(), ~finite):
        return True
    return bool((excess(candidate[finite], ref[finite], mag[finite], k) > 1).any())


def assert_contract(out: Tensor, ref: Tensor, mag: Tensor, k: int) -> None:
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), f"NaN at {int((out.isnan() != nan).sum())} wrong places"
    ratio = torch.zeros_like(ref)
    ratio[~nan] = excess(out[~nan], ref[~nan], mag[~nan], k)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if worst > 1:
        r, c = divmod(int(ratio.argmax()), ratio.shape[1])
        pytest.fail(f"FP8_SM90 bound violated: ratio {worst:.3g} at row {r} col {c}: out {float(out[r, c])} "
                    f"ref {float(ref[r, c])}")


FINITE = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def make(m: int, n: int, k: int, ends: Sequence[int], seed: int, x_bytes: tuple[int, int] = (118, 136),
         w_bytes: tuple[int, int] = (116, 132)) -> Case:
    """Random finite e4m3 codes; scale bytes uniform in the given ranges, so they differ per row and block."""
    g = torch.Generator().manual_seed(seed)
    e = len(ends)
    xq = FINITE[torch.randint(len(FINITE), (m, k), generator=g)]
    wq = FINITE[torch.randint(len(FINITE), (e, n, k), generator=g)]
    xs = torch.randint(*x_bytes, (m, k // BLK), generator=g, dtype=torch.uint8)
    ws = torch.randint(*w_bytes, (e, n // BLK, k // BLK), generator=g, dtype=torch.uint8)
    return Case(xq, xs, wq, ws, ends)


def check(m: int, n: int, k: int, counts: Sequence[int], seed: int = 0) -> None:
    case = make(m, n, k, cumsum(counts), seed)
    y = case.run()
    ref, mag = case.ref()
    assert_contract(y, ref, mag, k)


# ---------------------------------------------------------------------------------------------------------
# CPU: declarations, compiles, refusals, fake shapes, the oracle.
# ---------------------------------------------------------------------------------------------------------


def test_kernels_declare_sm90a_fp8_instructions() -> None:
    assert {s.op for s in KERNELS} == {"grouped_gemm_fp8"} and len({s.name for s in KERNELS}) == len(KERNELS)
    for spec in KERNELS:
        assert set(spec.expect) == set(spec.forbid) == {"sm_90a"}
        expect = spec.expect["sm_90a"]
        assert any("e4m3\\.e4m3" in rx for rx in expect) and any("bulk\\.tensor" in rx for rx in expect)
        assert r"\b(ld|st)\.local\b" in spec.forbid["sm_90a"]
        for rx in (*expect, *spec.forbid["sm_90a"]):
            re.compile(rx)


def test_fast_modules_list_the_glue() -> None:
    from nmoe.fast import FAST_MODULES

    assert "nmoe.fast.gemm.sm90_fp8" in FAST_MODULES


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.gemm.sm90_fp8")


def test_sm90a_kernels_compile_without_gpu(rows: dict[str, list[dict[str, Any]]]) -> None:
    assert [r["kernel"] for r in rows["sm_90a"]] == [s.name for s in KERNELS]
    assert_rows_ok(rows["sm_90a"], "sm_90a", len(KERNELS))


def test_sm100a_compile_is_not_run_naming_the_dispatcher(rows: dict[str, list[dict[str, Any]]]) -> None:
    for row in rows["sm_100a"]:
        assert row["status"] == "not run" and "nmoe.fast.gemm.grouped_gemm_fp8" in row["error"], row


_PROBE = r'''
import itertools, json, re
from nmoe.fast import runtime
from nmoe.fast.gemm import sm90_fp8 as gemm_fp8
runtime.import_cutlass("sm_90a")
import cutlass.cute as cute
from cutlass.base_dsl.ast_helpers import range_constexpr
from nmoe.fast.kernels.sm90 import grouped_gemm_fp8 as k

OPS = (r"setmaxnreg\.inc|ld\.global\.b8|mbarrier\.try_wait|wgmma\.fence|wgmma\.mma_async|"
       r"wgmma\.wait_group\.sync\.aligned\s+\d|fma\.rn\.f32|stmatrix")
out = {"ptx": {}, "coords": [], "ops": {}}
for spec in gemm_fp8.KERNELS:
    ptx = out["ptx"][spec.name] = spec.compile("sm_90a")
    ops = [re.sub(r"\s+", " ", o) for o in re.findall(OPS, ptx)]
    out["ops"][spec.name] = [[op, len(list(run))] for op, run in itertools.groupby(ops)]

@cute.jit
def fragment():
    mma = k.make_tiled_mma()
    out["shape"] = str(mma.get_slice(0).partition_shape_C((k.BM, k.BN)))
    for tid in range_constexpr(256):
        t_c = mma.get_slice(tid).partition_C(cute.make_identity_tensor((k.BM, k.BN)))
        for c in range_constexpr(0, 16, 5):
            for i in range_constexpr(2):
                for j in range_constexpr(2):
                    rc = t_c[((j, i, c), 0, 0)]
                    out["coords"].append((tid, j, i, c, int(rc[0]), int(rc[1])))

cute.compile(fragment)
print(json.dumps(out))
'''


@pytest.fixture(scope="session")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ptxas on the sm_90a PTX (where installed) and the accumulator fragment's (row, col) per thread."""
    script = tmp_path_factory.mktemp("fp8") / "probe.py"
    script.write_text(_PROBE)
    env = child_env(drop=("CUTE_DSL_ARCH",))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["ptxas"] = assemble(out.pop("ptx"), "sm_90a")
    return out


def test_sm90a_ptx_assembles_without_spills(probe: dict[str, Any]) -> None:
    """Two 64x128 fp32 accumulators per consumer thread must stay in registers (232 after setmaxnreg), and
    ptxas must neither inject a wgmma wait (C7517) nor serialize the wgmmas (C7514, C7518)."""
    if probe["ptxas"] is None:
        pytest.skip("ptxas not installed: PTX not assembled (the instruction checks above still ran)")
    assert set(probe["ptxas"]) == {s.name for s in KERNELS}
    for name, res in probe["ptxas"].items():
        assert res["rc"] == 0, (name, res["log"])
        assert "0 bytes spill stores, 0 bytes spill loads" in res["log"], (name, res["log"])
        assert not re.search(r"C751[478]|serialized", res["log"]), (name, res["log"])
        regs = int(re.findall(r"Used (\d+) registers", res["log"])[-1])
        assert regs <= 232, (name, regs)


def test_consumer_loop_waits_before_promoting(probe: dict[str, Any]) -> None:
    """Per K block: the 3 scale bytes load before the stage wait (hidden under TMA and MMA), one batch of 4
    k32 wgmmas, wait_group 0, then one FMA per accumulator value (64), then the next block or the epilogue."""
    body = [["ld.global.b8", 3], ["mbarrier.try_wait", 1], ["wgmma.fence", 1], ["wgmma.mma_async", 4],
            ["wgmma.wait_group.sync.aligned 0", 1], ["fma.rn.f32", 64], ["stmatrix", 8]]
    serial = {name: ops for name, ops in probe["ops"].items() if "overlap" not in name}
    assert serial
    for name, ops in serial.items():
        consumer = ops[[op for op, _ in ops].index("setmaxnreg.inc") + 1:]
        assert consumer[: len(body)] == body, (name, consumer)


def test_accumulator_rows_are_what_the_promotion_assumes(probe: dict[str, Any]) -> None:
    """_promote scales fragment value (j, i, c) with the scale of the thread's row pair member i; the
    wrong-operand separating test models a thread's first column as 2 (lane % 4)."""
    assert probe["shape"] == "((2, 2, 16), 1, 1)"
    first: dict[tuple[int, int], tuple[int, int]] = {}
    for tid, j, i, c, row, col in probe["coords"]:
        if (j, c) == (0, 0):
            first[(tid, i)] = (row, col)
    assert len(first) == 512
    for tid, j, i, c, row, col in probe["coords"]:
        assert row == first[(tid, i)][0], (tid, j, i, c)
        assert col == first[(tid, 0)][1] + j + 8 * c, (tid, j, i, c)
    for tid in range(256):
        lo, hi = first[(tid, 0)], first[(tid, 1)]
        assert hi[0] == lo[0] + 8 and lo[1] == hi[1] == 2 * (tid % 4)
        assert 64 * (tid // 128) <= lo[0] < 64 * (tid // 128) + 56
    assert len({first[(t, i)][0] for t in range(256) for i in range(2)}) == 128


def test_sm100a_is_refused_naming_the_dispatcher() -> None:
    with pytest.raises(ArchError, match=r"called on sm_100a.*nmoe\.fast\.gemm\.grouped_gemm_fp8"):
        require("grouped_gemm_fp8", "sm_100a", "sm_90a")


def _cpu_args(m: int = 4, n: int = 128, k: int = 256, e: int = 2) -> list[Tensor]:
    u8 = torch.uint8
    return [torch.zeros(m, k, dtype=u8), torch.zeros(m, k // BLK, dtype=u8), torch.zeros(e, n, k, dtype=u8),
            torch.zeros(e, n // BLK, k // BLK, dtype=u8), torch.tensor([2, 4][:e], dtype=torch.int32)]


@pytest.mark.parametrize("fn", [grouped_gemm_fp8, gemm.grouped_gemm_fp8])
def test_cpu_tensors_are_refused_naming_reference(fn: Callable[..., Tensor]) -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fn(*_cpu_args())


def _bad(i: int, t: Tensor) -> list[Tensor]:
    args = _cpu_args()
    args[i] = t
    return args


@pytest.mark.parametrize(("args", "match"), [
    (_bad(0, torch.zeros(4, 256)), r"xq is torch.float32.*bit patterns"),
    (_bad(3, torch.zeros(2, 1, 2, dtype=torch.int8)), r"ws is torch.int8"),
    (_bad(0, torch.zeros(4, 384, dtype=torch.uint8)), r"the same K"),
    (_cpu_args(k=200), r"multiples of 128"),
    (_cpu_args(n=136), r"multiples of 128"),
    (_bad(1, torch.zeros(4, 1, dtype=torch.uint8)), r"\[4, 2\] / \[2, 1, 2\].*quantize_mxfp8\(x, 128\)"),
    (_bad(3, torch.zeros(2, 2, 2, dtype=torch.uint8)), r"128x128 blocks"),
    (_bad(4, torch.tensor([2, 4])), r"int32 \[2\].*torch.cumsum"),
    (_bad(4, torch.tensor([4], dtype=torch.int32)), r"int32 \[2\]"),
])
def test_bad_inputs_raise_with_fix(args: list[Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemm_fp8._check(*args)


def test_too_many_groups_raise_with_fix() -> None:
    e = GEMM_MAX_GROUPS + 1
    args = _cpu_args(e=1)
    args[2] = torch.zeros(e, 128, 256, dtype=torch.uint8)
    args[3] = torch.zeros(e, 1, 2, dtype=torch.uint8)
    args[4] = torch.zeros(e, dtype=torch.int32)
    with pytest.raises(ValueError, match="split the experts"):
        gemm_fp8._check(*args)


def test_check_accepts_torch_fp8_dtypes_as_bytes() -> None:
    args = _cpu_args()
    args[0] = args[0].view(torch.float8_e4m3fn)
    args[3] = args[3].view(torch.float8_e8m0fnu)
    out = gemm_fp8._check(*args)
    assert [t.dtype for t in out] == [torch.uint8] * 4


def test_custom_op_has_fake_shapes() -> None:
    meta = [t.to("meta") for t in _cpu_args(m=5, n=256)]
    y = torch.ops.nmoe.grouped_gemm_fp8_sm90(*meta)
    assert (y.shape, y.dtype) == ((5, 256), torch.bfloat16)


def test_kernel_source_hash_covers_every_file_it_compiles() -> None:
    files = {ROOT / "nmoe/fast/kernels/sm90" / f for f in ("grouped_gemm_fp8.py", "grouped_gemm.py")}
    files |= {ROOT / "nmoe/fast/kernels/formats.py", ROOT / "nmoe/constants.py"}
    assert files <= set(op.source_files(gemm_fp8.FP8.module))


def test_oracle_decoders_hand_values() -> None:
    codes = torch.tensor([0x00, 0x01, 0x08, 0x38, 0x7E, 0xB8, 0x7F], dtype=torch.uint8)
    v = e4m3_f64(codes)
    assert v[:6].tolist() == [0.0, 2.0**-9, 2.0**-6, 1.0, 448.0, -1.0] and bool(v[6].isnan())
    s = e8m0_f64(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))
    assert s[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127] and bool(s[4].isnan())


def test_contract_is_the_registry_fp8_sm90_bound() -> None:
    assert (FP8_SM90.n, FP8_SM90.c, FP8_SM90.block) == (1, 2, 128)
    assert FP8_SM90.acc(1024) == 128 * 2.0**-14 + 8 * 2.0**-24
    ref = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mag = torch.tensor([2.0**6, 0.0], dtype=torch.float64)
    allowed = 2.0**-7 + 2 * (128 * 2.0**-14 + 2.0**-24) * 2.0**6
    assert float(excess(torch.tensor([1.0 + allowed, 0.0]), ref, mag, 128)[0]) == pytest.approx(1.0)
    assert violates(torch.tensor([1.0, 2.0**-132]), ref, mag, 128)
    assert violates(torch.tensor([1.0, float("nan")]), ref, mag, 128)
    assert not violates(torch.tensor([float("nan"), 0.0]), torch.tensor([float("nan"), 0.0]), mag, 128)


# ---------------------------------------------------------------------------------------------------------
# GPU (sm_90a): the forward against the float64 oracle.
# ---------------------------------------------------------------------------------------------------------


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90a (H100/H200) GPU: wgmma fp8 kernel not run")


@gpu
@sm90
def test_fwd_uniform() -> None:
    check(2048, 512, 1024, uniform_counts(2048, 8))


@gpu
@sm90
def test_fwd_zipf_skewed() -> None:
    check(4000, 512, 1024, zipf_counts(4000, 32), seed=1)


@gpu
@sm90
def test_fwd_empty_and_one_row_groups_and_ragged_m() -> None:
    counts = [0, 1, 0, 0, 129, 1, 2, 127, 0, 1, 300, 0]
    check(sum(counts) + 5, 256, 512, counts, seed=2)


@gpu
@sm90
@pytest.mark.parametrize(("n", "k"), [(256, 128), (384, 1024), (128, 256), (1024, 384)])
def test_fwd_n_tiles_and_k_blocks(n: int, k: int) -> None:
    check(700, n, k, [130, 0, 257, 3, 300], seed=3)


@gpu
@sm90
def test_fwd_rows_past_last_end_are_zero() -> None:
    case = make(300, 256, 256, cumsum([0, 5, 0]), seed=4)
    y = torch.full((300, 256), float("nan"), dtype=torch.bfloat16, device=DEV)
    gemm_fp8._launch(case.xq, case.xs, case.wq, case.ws, case.offs(), y)
    assert bool((y[5:] == 0).all())
    ref, mag = case.ref()
    assert_contract(y, ref, mag, 256)


@gpu
@sm90
@pytest.mark.parametrize("counts", [[0, 0, 0], [333], [0, 0, 333]])
def test_fwd_degenerate_routings(counts: list[int]) -> None:
    check(333, 256, 256, counts, seed=5)


@gpu
@sm90
def test_fwd_many_groups() -> None:
    check(6000, 256, 256, zipf_counts(6000, 256), seed=6)


@gpu
@sm90
def test_fwd_scale_byte_extremes() -> None:
    """Byte 0 is the fp32 subnormal 2^-127, not 0: rows 0..49 (x bytes 0, w bytes 150) give about 2^-104 P.
    Elsewhere scale products span 2^-254 .. 2^96, within fp32 and bf16 range for these codes."""
    case = make(400, 256, 512, cumsum([150, 250]), seed=7)
    g = torch.Generator().manual_seed(7)
    xb, wb = torch.tensor([0, 1, 60, 127, 200]), torch.tensor([0, 100, 127, 150])
    xs = xb[torch.randint(len(xb), tuple(case.xs.shape), generator=g)].to(torch.uint8)
    ws = wb[torch.randint(len(wb), tuple(case.ws.shape), generator=g)].to(torch.uint8)
    xs[:50] = 0
    ws[0] = 150
    case = Case(case.xq.cpu(), xs, case.wq.cpu(), ws, case.ends)
    ref, mag = case.ref()
    assert bool((ref[:50].abs() > 2.0**-120).all())
    assert_contract(case.run(), ref, mag, 512)


@gpu
@sm90
def test_fwd_nan_codes_and_nan_scale_bytes() -> None:
    case = make(300, 256, 384, cumsum([100, 150, 50]), seed=8)
    xq, xs, wq, ws = (t.cpu().clone() for t in (case.xq, case.xs, case.wq, case.ws))
    xs[3, 1] = 255
    ws[1, 1, 0] = 255
    xq[10, 5] = 0x7F
    wq[2, 7, 200] = 0xFF
    case = Case(xq, xs, wq, ws, case.ends)
    ref, mag = case.ref()
    assert int(ref.isnan().sum()) == 2 * 256 + 150 * 128 + 50
    assert_contract(case.run(), ref, mag, 384)


@gpu
@sm90
def test_fwd_from_fast_quantizers() -> None:
    from nmoe.fast import formats

    g = torch.Generator(device="cuda").manual_seed(9)
    counts = [300, 0, 212, 500]
    x = torch.randn(sum(counts), 1024, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(4, 512, 1024, device="cuda", generator=g) * 0.03
    xq, xs = formats.quantize_mxfp8(x, 128)
    wq, ws = formats.quantize_mxfp8_weight(w)
    case = Case(xq, xs, wq, ws, cumsum(counts))
    ref, mag = case.ref()
    assert_contract(case.run(), ref, mag, 1024)


@gpu
@sm90
def test_dispatcher_runs_this_kernel_on_sm90a() -> None:
    case = make(500, 256, 256, cumsum([200, 0, 300]), seed=10)
    y = gemm.grouped_gemm_fp8(case.xq, case.xs, case.wq, case.ws, case.offs())
    assert torch.equal(y, case.run())
    ref, mag = case.ref()
    assert_contract(y, ref, mag, 256)


@gpu
@sm90
def test_routing_change_needs_no_sync_and_no_recompile() -> None:
    case = make(1024, 256, 256, cumsum(uniform_counts(1024, 8)), seed=11)
    case.run()
    compiles = [ev for ev in runtime.kernel_cache().events if ev.how == "compile"]
    case.ends = cumsum(zipf_counts(1000, 8))
    offs = case.offs()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_gemm_fp8(case.xq, case.xs, case.wq, case.ws, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [ev for ev in runtime.kernel_cache().events if ev.how == "compile"] == compiles
    ref, mag = case.ref()
    assert_contract(y, ref, mag, 256)


@gpu
@sm90
def test_cuda_graph_replay_follows_new_offs() -> None:
    case = make(1024, 256, 256, cumsum(uniform_counts(1024, 8)), seed=12)
    offs = case.offs()
    grouped_gemm_fp8(case.xq, case.xs, case.wq, case.ws, offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_gemm_fp8(case.xq, case.xs, case.wq, case.ws, offs)
    case.ends = cumsum([0, 500, 3, 0, 0, 200, 1, 250])
    offs.copy_(case.offs())
    graph.replay()
    torch.cuda.synchronize()
    ref, mag = case.ref()
    assert_contract(y, ref, mag, 256)


# ---------------------------------------------------------------------------------------------------------
# Separating inputs for the GPU mutations of nmoe/fast/kernels/sm90/grouped_gemm_fp8.py: each test first shows
# the correct and the mutated formula differ beyond the bound on its data, then checks the kernel.
# ---------------------------------------------------------------------------------------------------------


def _separates(case: Case, mutated: Tensor) -> tuple[Tensor, Tensor]:
    ref, mag = case.ref()
    assert_contract(case.formula().to(torch.bfloat16), ref, mag, case.k)
    assert violates(mutated, ref, mag, case.k)
    return ref, mag


def _tile_row0(ends: Sequence[int], m: int) -> Tensor:
    """First row of the 128-row tile holding each row: tiles start at each group's first row."""
    row0 = torch.arange(m)
    for s, t in ends_to_ranges([*ends, m]):
        row0[s:t] = s + (row0[s:t] - s) // BLK * BLK
    return row0.to(DEV)


@gpu
@sm90
def test_sep_gemm_fast_fp8_scale_wrong_operand() -> None:
    """Mutant: x scale looked up at the accumulator's column, not its row. A thread's first accumulator sits
    at tile column 2 (lane % 4) (wgmma m64 fragment): output (r, c) takes row tile_row0 + (c mod 8 // 2) 2."""
    case = make(260, 256, 256, cumsum([130, 70, 60]), seed=13)
    cols = torch.arange(case.n, device=DEV)
    rows = _tile_row0(case.ends, case.m)[:, None] + cols[None, :] % 8 // 2 * 2
    sx = case.sx.t()[:, rows.clamp_max(case.m - 1)]
    ref, mag = _separates(case, case.formula(sx=sx))
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
def test_sep_gemm_fast_fp8_no_promotion() -> None:
    """Mutant: the block accumulator is never reset, so each block's scales multiply the running sum."""
    case = make(300, 256, 512, cumsum([100, 200]), seed=14)
    ref, mag = _separates(case, case.formula(p=case.blocks().cumsum(0)))
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
@pytest.mark.parametrize("k", [256, 384])
def test_sep_gemm_fast_fp8_skip_last_k_block(k: int) -> None:
    """Two and three K blocks: with one, the mutant's zero-block tiles leave the overlapped consumer waiting
    for a block no producer loads (a hang, not a verdict)."""
    case = make(200, 256, k, cumsum([130, 70]), seed=15)
    kb = k // BLK
    kept = slice(0, kb - 1)
    mutated = case.formula(sx=case.x_scale()[kept], sw=case.w_scale()[kept], p=case.blocks()[kept])
    ref, mag = _separates(case, mutated)
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
def test_sep_gemm_fast_fp8_weight_scale_first_n_block() -> None:
    """Mutant: every N tile takes the weight scale of the expert's first 128-column block."""
    case = make(200, 384, 256, cumsum([120, 80]), seed=16)
    ref, mag = _separates(case, case.formula(sw=case.w_scale(n_block=lambda c: c * 0)))
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
def test_sep_gemm_fast_fp8_nan_scale_as_inf() -> None:
    """Mutant: scale byte 255 decodes as +Inf (plain b << 23), so its blocks give +-Inf instead of NaN."""
    case = make(200, 256, 256, cumsum([120, 80]), seed=17)
    xs, ws = case.xs.cpu().clone(), case.ws.cpu().clone()
    xs[7, 1] = 255
    ws[1, 1, 0] = 255
    case = Case(case.xq.cpu(), xs, case.wq.cpu(), ws, case.ends)
    sx, sw = case.x_scale(), case.w_scale()
    mutated = case.formula(sx=sx.where(~sx.isnan(), torch.inf), sw=sw.where(~sw.isnan(), torch.inf))
    ref, mag = _separates(case, mutated)
    assert_contract(case.run(), ref, mag, case.k)
