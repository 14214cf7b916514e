"""nmoe.fast.gemm.sm100 (tcgen05 grouped GEMM: bf16, MXFP8, NVFP4): scale packers against a hand-written
index formula, refusals, sm_100a compiles checked for instructions (and by ptxas where installed) without
a GPU; on a B200, results against a float64 oracle decoded independently (ml_dtypes / hand tables)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from fastcompile import assemble
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fast_gemm import child_env
from torch import Tensor

from nmoe.fast import op, runtime
from nmoe.fast.arch import ArchError
from nmoe.fast.gemm import sm100 as gemm_sm100
from nmoe.fast.gemm.routing import require, tile_upper_bound
from nmoe.fast.gemm.sm100 import KERNELS, grouped_gemm, grouped_gemm_fp8, grouped_gemm_nvfp4
from nmoe.fast.kernels.sm100 import scale_layout

ROOT = Path(__file__).resolve().parents[1]


def _is_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)


sm100 = pytest.mark.skipif(not _is_sm100(), reason="needs an sm_100a (B200) GPU: tcgen05 kernels not run")

# ---------------------------------------------------------------------------------------------------------
# Oracle for the scale layout: the byte offset of scale (row r, column c, batch l), written from the
# tcgen05 block-scaled MMA's 128x4 atom description (32-row groups interleaved at 16-byte pitch).
# ---------------------------------------------------------------------------------------------------------


def atom_offset(r: int, c: int, l: int, rows: int, cols: int) -> int:
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    atom = (l * row_blocks + r // 128) * col_blocks + c // 4
    return atom * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def packed_by_formula(scales: np.ndarray, cols_multiple: int = 4,
                      offset: Callable[..., int] = atom_offset) -> np.ndarray:
    lead, rows, cols = scales.shape
    padded_cols = -(-cols // cols_multiple) * cols_multiple
    out = np.zeros(lead * (-(-rows // 128) * 128) * padded_cols, dtype=np.uint8)
    for l in range(lead):
        for r in range(rows):
            for c in range(cols):
                out[offset(r, c, l, rows, padded_cols)] = scales[l, r, c]
    return out


def group_rows_by_formula(counts: list[int]) -> list[int]:
    """Padded row of each routed row: group e starts at 128 * sum_{j<e} ceil(count_j / 128)."""
    dest, block = [], 0
    for c in counts:
        dest += [block * 128 + i for i in range(c)]
        block += -(-c // 128)
    return dest


def _u8(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.randint(1, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------------------
# CPU: packers.
# ---------------------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(lead=st.integers(1, 3), rows=st.integers(1, 300), cols=st.integers(1, 11),
       mult=st.sampled_from([4, 16]), seed=st.integers(0, 2**16))
def test_pack_atoms_matches_formula(lead: int, rows: int, cols: int, mult: int, seed: int) -> None:
    s = _u8((lead, rows, cols), seed)
    got = scale_layout.pack_atoms(s, mult).numpy()
    assert np.array_equal(got, packed_by_formula(s.numpy(), mult))


def test_pack_atoms_hand_vector() -> None:
    s = torch.zeros(1, 128, 4, dtype=torch.uint8)
    s[0, 0, 0], s[0, 1, 0], s[0, 32, 0], s[0, 33, 3], s[0, 127, 3] = 1, 2, 3, 4, 5
    got = scale_layout.pack_atoms(s)
    assert got.numel() == 512
    assert {i: int(v) for i, v in enumerate(got.tolist()) if v} == {0: 1, 16: 2, 4: 3, 16 + 4 + 3: 4, 511: 5}


@pytest.mark.parametrize("counts,tail", [([0, 1, 130, 0, 127, 256, 5], 9), ([300], 0), ([0, 0], 7),
                                         ([128, 128, 1], 200)])
def test_pack_grouped_rows_matches_formula(counts: list[int], tail: int) -> None:
    m, cols = sum(counts) + tail, 6
    s = _u8((m, cols), sum(counts))
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    got = scale_layout.pack_grouped_rows(s, offs, 4).numpy()
    cap_rows = scale_layout.grouped_row_blocks(m, len(counts)) * 128
    padded = np.zeros((1, cap_rows, cols), dtype=np.uint8)
    for src, dst in enumerate(group_rows_by_formula(counts)):
        padded[0, dst] = s[src].numpy()
    assert np.array_equal(got, packed_by_formula(padded, 4))


def test_grouped_capacity_bounds_every_routing() -> None:
    for counts in ([127] * 9, [1] * 40, [0] * 5 + [1000], [129, 255, 1, 0]):
        used = sum(-(-c // 128) for c in counts)
        assert used <= scale_layout.grouped_row_blocks(sum(counts), len(counts))


def test_pack_grouped_rows_reads_offs_as_the_kernel_clamps_them() -> None:
    s = _u8((10, 4), 3)
    bad = torch.tensor([6, 4, 50], dtype=torch.int32)
    good = torch.tensor([6, 6, 10], dtype=torch.int32)
    assert torch.equal(scale_layout.pack_grouped_rows(s, bad), scale_layout.pack_grouped_rows(s, good))


def test_fp8_scale_expansion_is_exact_repeat() -> None:
    xs, ws = _u8((5, 3), 1), _u8((2, 2, 3), 2)
    xs32, ws32 = scale_layout.expand_fp8_act_scales(xs), scale_layout.expand_fp8_weight_scales(ws)
    assert xs32.shape == (5, 12) and ws32.shape == (2, 256, 12)
    for m, j in ((0, 0), (4, 11), (2, 5)):
        assert xs32[m, j] == xs[m, j // 4]
    for e, n, j in ((0, 0, 0), (1, 255, 11), (1, 128, 4), (0, 127, 3)):
        assert ws32[e, n, j] == ws[e, n // 128, j // 4]


def test_cols_multiple_is_tile_k_over_scale_block() -> None:
    assert scale_layout.COLS_MULTIPLE == {"mxfp8": 128 // 32, "nvfp4": 256 // 16}


def _rows_swapped_offset(r: int, c: int, l: int, rows: int, cols: int) -> int:
    base = atom_offset(r - r % 128, c, l, rows, cols) - c % 4
    return base + ((r % 128) // 32) * 16 + (r % 32) * 4 + c % 4


def test_sep_sf_atom_rows_swapped() -> None:
    """Mutation: 32-row group and row-in-group strides exchanged (128x4 read as 4x32 groups)."""
    s = _u8((1, 128, 4), 11).numpy()
    right, wrong = packed_by_formula(s), packed_by_formula(s, offset=_rows_swapped_offset)
    assert not np.array_equal(right, wrong)
    assert np.array_equal(scale_layout.pack_atoms(torch.from_numpy(s)).numpy(), right)


def test_sep_sf_groups_not_padded() -> None:
    """Mutation: activation rows packed densely (ignoring expert boundaries) instead of per-group padding."""
    counts = [5, 130]
    s = _u8((135, 4), 12)
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    got = scale_layout.pack_grouped_rows(s, offs)
    dense = scale_layout.pack_atoms(torch.cat((s, s.new_zeros(got.numel() // 4 - 135, 4))))
    assert not torch.equal(got, dense)
    padded = np.zeros((1, got.numel() // 4, 4), dtype=np.uint8)
    for src, dst in enumerate(group_rows_by_formula(counts)):
        padded[0, dst] = s[src].numpy()
    assert np.array_equal(got.numpy(), packed_by_formula(padded))


# ---------------------------------------------------------------------------------------------------------
# CPU: declarations and refusals.
# ---------------------------------------------------------------------------------------------------------


def test_kernels_declare_sm100a_only() -> None:
    assert [s.op for s in KERNELS] == ["grouped_gemm", "grouped_gemm_fp8", "grouped_gemm_nvfp4"]
    for spec in KERNELS:
        assert set(spec.expect) == set(spec.forbid) == {"sm_100a"}
        for rx in (*spec.expect["sm_100a"], *spec.forbid["sm_100a"]):
            re.compile(rx)
        with pytest.raises(NotImplementedError, match=r"not built for sm_90a.*nmoe\.fast\.gemm"):
            spec.compile("sm_90a")


def _cpu_args() -> dict[str, tuple[Tensor, ...]]:
    offs = torch.tensor([2, 4], dtype=torch.int32)
    u8, bf16 = torch.uint8, torch.bfloat16
    return {
        "bf16": (torch.zeros(4, 128, dtype=bf16), torch.zeros(2, 8, 128, dtype=bf16), offs),
        "fp8": (torch.zeros(4, 128, dtype=u8), torch.zeros(4, 4, dtype=u8), torch.zeros(2, 8, 128, dtype=u8),
                torch.zeros(2, 8, 4, dtype=u8), offs),
        "nvfp4": (torch.zeros(4, 64, dtype=u8), torch.zeros(4, 8, dtype=u8), torch.ones(()),
                  torch.zeros(2, 8, 64, dtype=u8), torch.zeros(2, 8, 8, dtype=u8), torch.ones(()), offs),
    }


@pytest.mark.parametrize("fmt,fn", [("bf16", grouped_gemm), ("fp8", grouped_gemm_fp8),
                                    ("nvfp4", grouped_gemm_nvfp4)])
def test_cpu_tensors_are_refused_naming_reference(fmt: str, fn: Callable[..., Tensor]) -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fn(*_cpu_args()[fmt])


@pytest.mark.parametrize("name", ["grouped_gemm", "grouped_gemm_fp8", "grouped_gemm_nvfp4"])
def test_sm90a_refusal_names_the_front(name: str) -> None:
    with pytest.raises(ArchError, match=rf"sm_100a kernel, called on sm_90a.*nmoe\.fast\.gemm\.{name},"):
        require(name, "sm_90a", "sm_100a")


def test_grid_bound_covers_routing_with_tail() -> None:
    for counts, tail, n, bn in (([0, 1, 130], 5, 300, 128), ([128] * 4, 0, 256, 256), ([1] * 9, 127, 8, 128)):
        tiles = sum(-(-c // 128) for c in [*counts, tail]) * -(-n // bn)
        assert tiles <= tile_upper_bound(sum(counts) + tail, n, len(counts), bn)


def test_kernel_source_hash_covers_the_kernel_file() -> None:
    assert ROOT / "nmoe/fast/kernels/sm100/grouped_gemm.py" in op.source_files(gemm_sm100.GEMM.module)


# ---------------------------------------------------------------------------------------------------------
# CPU: sm_100a compiles in a fresh process (CuTeDSL fixes its arch at import), plus the DSL's own
# scale-factor layout evaluated at sampled coordinates.
# ---------------------------------------------------------------------------------------------------------

_PROBE = r'''
import json, re, time
from nmoe.fast import runtime
from nmoe.fast.gemm import sm100 as gemm_sm100
runtime.import_cutlass("sm_100a")
import cutlass.cute as cute
import cutlass.utils.blockscaled_layout as sfl
from nmoe.fast.kernels.sm100 import grouped_gemm as kern

rows = []
for spec in gemm_sm100.KERNELS:
    t0 = time.perf_counter()
    ptx = spec.compile("sm_100a")
    row = {"kernel": spec.name, "seconds": round(time.perf_counter() - t0, 2),
           "expect": {rx: bool(re.search(rx, ptx)) for rx in spec.expect["sm_100a"]},
           "forbid": {rx: bool(re.search(rx, ptx)) for rx in spec.forbid["sm_100a"]},
           "mma": sorted(set(re.findall(r"tcgen05\.mma\.cta_group::\d\.kind::\w+(?:\.block_scale\.block\d+)?",
                                        ptx))),
           "mma_full": sorted(set(re.findall(r"tcgen05\.mma\S*", ptx))), "ptx": ptx}
    rows.append(row)

cases = [((256, 192, 3), 16), ((384, 128, 2), 32)]
probes = []
@cute.jit
def probe():
    for shape, vec in cases:
        lay = sfl.tile_atom_to_shape_SF(shape, vec)
        pts = []
        for m in (0, 1, 31, 32, 33, 95, 127, 128, 129, 200, shape[0] - 1):
            for kb in sorted({0, 1, 3, 4, 5, shape[1] // vec - 1} & set(range(shape[1] // vec))):
                for l in (0, shape[2] - 1):
                    pts.append([m, kb, l, cute.crd2idx((m, kb * vec, l), lay)])
        probes.append({"shape": list(shape), "vec": vec, "points": pts})
cute.compile(probe)
cols = {f: kern.FORMATS[f].tile_k // kern.FORMATS[f].sf_vec for f in ("mxfp8", "nvfp4")}
print(json.dumps({"rows": rows, "probes": probes, "cols": cols}))
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    script = tmp_path_factory.mktemp("sm100") / "probe.py"
    script.write_text(_PROBE)
    env = child_env({"CUTE_DSL_ARCH": "sm_100a"})
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = assemble({r["kernel"]: r.pop("ptx") for r in out["rows"]}, "sm_100a")
    for r in out["rows"]:
        r["ptxas"] = None if runs is None else runs[r["kernel"]]
    return out


def test_sm100a_kernels_compile_with_expected_instructions(probe: dict[str, Any]) -> None:
    rows = probe["rows"]
    assert [r["kernel"] for r in rows] == [s.name for s in KERNELS]
    for row in rows:
        assert all(row["expect"].values()), row
        assert not any(row["forbid"].values()), row
    kinds = [r["mma"] for r in rows]
    assert kinds[0] == ["tcgen05.mma.cta_group::1.kind::f16"]
    assert kinds[1] == ["tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32"]
    assert kinds[2] == ["tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"]


def test_sm100a_ptx_assembles_without_spills(probe: dict[str, Any]) -> None:
    for row in probe["rows"]:
        if row["ptxas"] is None:
            pytest.skip("ptxas not installed: PTX not assembled (instruction checks above still ran)")
        assert row["ptxas"]["rc"] == 0, row["ptxas"]["log"]
        assert "0 bytes spill stores, 0 bytes spill loads" in row["ptxas"]["log"], row["ptxas"]["log"]


def test_dsl_scale_layout_matches_the_hand_formula(probe: dict[str, Any]) -> None:
    for case in probe["probes"]:
        rows, k, _ = case["shape"]
        cols = k // case["vec"]
        for m, kb, l, idx in case["points"]:
            assert idx == atom_offset(m, kb, l, rows, cols), (case["shape"], m, kb, l)


def test_kernel_tile_k_matches_packer_padding(probe: dict[str, Any]) -> None:
    assert probe["cols"] == scale_layout.COLS_MULTIPLE


# ---------------------------------------------------------------------------------------------------------
# GPU (sm_100a only): float64 oracle from independently decoded operands; bound(1, 2) as in the contract.
# ---------------------------------------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dec_e4m3(codes: Tensor) -> np.ndarray:
    out: np.ndarray = codes.cpu().numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return out


def dec_e8m0(b: Tensor) -> np.ndarray:
    return np.exp2(b.cpu().numpy().astype(np.float64) - 127.0)


def dec_e2m1(packed: Tensor) -> np.ndarray:
    p = packed.cpu().numpy()
    codes = np.stack((p & 0xF, p >> 4), axis=-1).reshape(*p.shape[:-1], -1)
    mag = np.array(E2M1)[codes & 7]
    out: np.ndarray = np.where(codes & 8, -mag, mag)
    return out


def bound_ratio(y: Tensor, a: np.ndarray, b: np.ndarray, offs: list[int], m: int) -> float:
    """max |y - ref| / (ulp_bf16(ref) + 2 K 2^-24 |a||b|), b [N, K, E]; rows past the end must be 0."""
    k = a.shape[1]
    ref, mag = np.zeros((m, b.shape[0])), np.zeros((m, b.shape[0]))
    start = 0
    for e, end in enumerate(offs):
        ref[start:end] = a[start:end] @ b[:, :, e].T
        mag[start:end] = np.abs(a[start:end]) @ np.abs(b[:, :, e]).T
        start = end
    got = y.float().cpu().numpy().astype(np.float64)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126))) - 7)
    ratio = np.abs(got - ref) / (ulp + 2 * k * 2.0**-24 * mag)
    return float(np.nan_to_num(ratio, nan=math.inf).max()) if ratio.size else 0.0


def _routing(counts: list[int], tail: int) -> tuple[list[int], int, Tensor]:
    ends = np.cumsum(counts).tolist()
    return ends, sum(counts) + tail, torch.tensor(ends, dtype=torch.int32, device="cuda")


CASES = [([0, 1, 130, 0, 127, 256, 5], 9), ([300], 0), ([0, 0, 3], 0), ([128] * 3, 130)]


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("counts,tail", CASES)
@pytest.mark.parametrize("n,k", [(200, 200), (2048, 256)])
def test_bf16_grouped_gemm(counts: list[int], tail: int, n: int, k: int) -> None:
    ends, m, offs = _routing(counts, tail)
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(len(counts), n, k, generator=g).bfloat16()
    y = grouped_gemm(x.cuda(), w.cuda(), offs)
    b = w.double().numpy().transpose(1, 2, 0)
    assert bound_ratio(y, x.double().numpy(), b, ends, m) <= 1.0
    assert not y[ends[-1] if ends else 0:].any()


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("counts,tail", CASES)
@pytest.mark.parametrize("mx_scales", [True, False])
def test_fp8_grouped_gemm(counts: list[int], tail: int, mx_scales: bool) -> None:
    ends, m, offs = _routing(counts, tail)
    n, k, e = 256, 384, len(counts)
    g = torch.Generator().manual_seed(m)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    xq = finite[torch.randint(len(finite), (m, k), generator=g)]
    wq = finite[torch.randint(len(finite), (e, n, k), generator=g)]
    xs = torch.randint(120, 134, (m, k // 32) if mx_scales else (m, k // 128), generator=g, dtype=torch.uint8)
    ws_shape = (e, n, k // 32) if mx_scales else (e, n // 128, k // 128)
    ws = torch.randint(120, 134, ws_shape, generator=g, dtype=torch.uint8)
    y = grouped_gemm_fp8(xq.cuda(), xs.cuda(), wq.cuda(), ws.cuda(), offs)
    xs_b = xs.repeat_interleave(32 if mx_scales else 128, -1)
    ws_b = ws.repeat_interleave(32 if mx_scales else 128, -1)
    if not mx_scales:
        ws_b = ws_b.repeat_interleave(128, -2)
    a = dec_e4m3(xq) * dec_e8m0(xs_b)
    b = (dec_e4m3(wq) * dec_e8m0(ws_b)).transpose(1, 2, 0)
    assert bound_ratio(y, a, b, ends, m) <= 1.0


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("counts,tail", CASES)
@pytest.mark.parametrize("k", [256, 320])
def test_nvfp4_grouped_gemm(counts: list[int], tail: int, k: int) -> None:
    ends, m, offs = _routing(counts, tail)
    n, e = 200, len(counts)
    g = torch.Generator().manual_seed(m + k)
    xp = torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8)
    wp = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    xbs = torch.randint(0x28, 0x48, (m, k // 16), generator=g, dtype=torch.uint8)
    wbs = torch.randint(0x28, 0x48, (e, n, k // 16), generator=g, dtype=torch.uint8)
    xts, wts = torch.tensor(0.37), torch.tensor(1.9)
    y = grouped_gemm_nvfp4(xp.cuda(), xbs.cuda(), xts.cuda(), wp.cuda(), wbs.cuda(), wts.cuda(), offs)
    a = dec_e2m1(xp) * dec_e4m3(xbs).repeat(16, -1) * float(xts)
    b = (dec_e2m1(wp) * dec_e4m3(wbs).repeat(16, -1) * float(wts)).transpose(1, 2, 0)
    assert bound_ratio(y, a, b, ends, m) <= 1.0


@pytest.mark.gpu
@sm100
def test_routing_change_needs_no_recompile() -> None:
    x = torch.randn(500, 256, device="cuda").bfloat16()
    w = torch.randn(4, 256, 256, device="cuda").bfloat16()
    grouped_gemm(x, w, torch.tensor([100, 100, 400, 500], dtype=torch.int32, device="cuda"))
    before = len(runtime.kernel_cache().events)
    grouped_gemm(x, w, torch.tensor([0, 250, 251, 499], dtype=torch.int32, device="cuda"))
    assert len(runtime.kernel_cache().events) == before
