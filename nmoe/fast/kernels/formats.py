"""CuTeDSL kernels for MX-FP8 (1xB and 128x128 blocks) and NVFP4 quantize/dequantize, bit-exact: exact fp32
rounding (integer on the bits, or Veltkamp's split) plus one exact `add.rn` for the subnormal grid, no
hardware narrowing cvt. Import only after nmoe.fast.runtime.import_cutlass(arch)."""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint8, Uint32
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl import select_

from nmoe.constants import E4M3_MAX, F32_CANONICAL_NAN, NVFP4_BLOCK
from nmoe.constants import FP8_WEIGHT_BLOCK as WEIGHT_BLOCK
from nmoe.fast.kernels.prims import PDL, add_rn, await_upstream, div_rn, f2i, fma_rn, i2f, mul_rn, sel

THREADS = 256
QUANT_VECS = 2  # vectors each mx_quant / nvfp4_quant thread loads before encoding: twice the bytes in flight
AMAX_VECS = 4  # loads in flight per thread in nvfp4_amax_kernel
DTYPES: dict[str, Any] = {"bfloat16": BFloat16, "float16": Float16, "float32": Float32}
# fp32 bit patterns the encoders compare against (non-negative floats order like their bits).
F32_INF = 0x7F800000
F32_448 = 0x43E00000
F32_6 = 0x40C00000
F32_MIN_E4M3_NORMAL = 0x3C800000  # 2^-6
F32_MANT_1_75 = 0x600000
SIGN_BYTES = -2139062144  # 0x80808080
F32_ONE = 0x3F800000  # e2m1's smallest normal
# Adding 2^14 (ulp 2^-9) or 2^22 (ulp 0.5) rounds |v| onto the e4m3 / e2m1 subnormal grid, RNE, exactly.
E4M3_SUB_MAGIC = 16384.0
E4M3_SUB_MAGIC_BITS = 0x46800000
# Veltkamp's splitter 2^20 + 1 and the e4m3 rebias 2^-120, both exact in fp32 (see e4m3_mag_byte).
E4M3_REBIAS = 2.0**-120
E4M3_SPLIT = 1048577.0 * E4M3_REBIAS
E2M1_SUB_MAGIC = 4194304.0
E2M1_SUB_MAGIC_BITS = 0x4A800000
F32_QUIET_BIT = 0x00400000


def rne_code(a: Int32, mbits: int, min_normal: int, magic: float, magic_bits: int) -> Int32:
    """Magnitude code of the non-negative fp32 bits `a` (already clamped to the format max), RNE."""
    # Normal range: round the fp32 mantissa to `mbits` bits on the integer pattern (the carry bumps the
    # exponent); subnormal range: one exact add of a power of two whose ulp is the format's subnormal step.
    drop = 23 - mbits
    half = (1 << (drop - 1)) - 1
    rebias = (126 + ((min_normal >> 23) - 127)) << mbits
    normal = ((a + half + ((a >> drop) & 1)) >> drop) - rebias
    sub = f2i(add_rn(i2f(a), magic)) - magic_bits
    return sel(a < min_normal, sub, normal)


def e4m3_mag(a: Int32) -> Int32:
    return rne_code(Int32(cutlass_min(a, F32_448)), 3, F32_MIN_E4M3_NORMAL, E4M3_SUB_MAGIC,
                    E4M3_SUB_MAGIC_BITS)


def e2m1_mag(a: Int32) -> Int32:
    return rne_code(Int32(cutlass_min(a, F32_6)), 1, F32_ONE, E2M1_SUB_MAGIC, E2M1_SUB_MAGIC_BITS)


def cutlass_min(a: Any, b: Any) -> Int32:
    return sel(Int32(a) < Int32(b), a, b)


def cutlass_max(a: Any, b: Any) -> Int32:
    return sel(Int32(a) > Int32(b), a, b)


def cutlass_min64(a: Any, b: Any) -> Int64:
    return Int64(select_(Int64(a) < Int64(b), Int64(a), Int64(b)))


def e4m3_value_bits(c: Int32) -> Int32:
    """Exact fp32 bits of the e4m3 code c (0..255), NaN codes excluded by the caller."""
    e = (c >> 3) & 0xF
    m = c & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = f2i(add_rn(i2f(E4M3_SUB_MAGIC_BITS + m), -E4M3_SUB_MAGIC))
    return Int32(sel(e > 0, normal, sub) | ((c >> 7) << 31))


def e2m1_value_bits(c: Int32) -> Int32:
    e = (c >> 1) & 3
    m = c & 1
    normal = ((e + 126) << 23) | (m << 22)
    sub = sel(m > 0, 0x3F000000, 0)
    return Int32(sel(e > 0, normal, sub) | (((c >> 3) & 1) << 31))


def e8m0_scale_bits(b: Int32) -> Int32:
    """fp32 bits of 2^(127-b) for b in [1, 255]: the multiplier that undoes an MX scale byte."""
    return sel(b < 254, (254 - b) << 23, F32_QUIET_BIT >> (b - 254))


def mx_byte(amax: Int32) -> Int32:
    """The MX scale byte ceil(log2(amax/448)) exactly as the spec reads it off s = fp32(amax/448), clamped to
    [1, 254], 255 if not finite, found from amax's bits without a division."""
    # With amax = M * 2^E, fp32(amax/448) is a power of two iff M == 1.75, and it has exponent E-8 for
    # M >= 1.75, else E-9; so byte = biased(amax) - 8 + (mantissa > 1.75's). The equivalence was checked for
    # every finite non-negative fp32 amax (2^31 - 2^23 values).
    byte = (amax >> 23) - 8 + sel((amax & 0x7FFFFF) > F32_MANT_1_75, 1, 0)
    byte = cutlass_max(cutlass_min(byte, 254), 1)
    return sel(amax < F32_INF, byte, 255)


def e4m3_mag_byte(v: Float32) -> Int32:
    """Byte 3 is the RNE e4m3 code of |v| clamped to 448: below 2^-6 byte 0 of fp32(|v| + 2^14), above
    Veltkamp's split (c = 2^20 + 1) of |v| * 2^-120, whose bits are code << 20 (checked for all finite
    fp32). Float ops and IMADs keep it off the ALU pipe, which bounds the MX-FP8 quantizers."""
    a = f2i(cute.arch.fmin(Float32(cute.math.absf(v)), E4M3_MAX))
    m = i2f(a)
    c_m = mul_rn(m, E4M3_SPLIT)
    normal = f2i(add_rn(c_m, fma_rn(m, E4M3_REBIAS, -c_m))) << 4
    sub = f2i(add_rn(m, E4M3_SUB_MAGIC)) << 24
    return sel(a < F32_MIN_E4M3_NORMAL, sub, normal)


def prmt(a: Any, b: Any, selector: int) -> Int32:
    return Int32(cute.arch.prmt(Int32(a), Int32(b), selector))


def pack_bytes(m0: Int32, m1: Int32, m2: Int32, m3: Int32) -> Int32:
    """Byte 3 of each of four registers, packed little-endian into one word (3 PRMTs)."""
    return prmt(prmt(m0, m1, 0x0073), prmt(m2, m3, 0x0073), 0x5410)


def sign_bytes(words: Any, q: int, dtype_name: str) -> Int32:
    """Sign bits of elements 4q..4q+3 of the raw input words, as bit 7 of each byte of one word."""
    if dtype_name == "float32":
        lo = prmt(words[4 * q], words[4 * q + 1], 0x0073)
        hi = prmt(words[4 * q + 2], words[4 * q + 3], 0x0073)
        return Int32(prmt(lo, hi, 0x5410) & SIGN_BYTES)
    return Int32(prmt(words[2 * q], words[2 * q + 1], 0x7531) & SIGN_BYTES)


def sign_bit(words: Any, j: int, dtype_name: str) -> Int32:
    if dtype_name == "float32":
        return Int32((words[j] >> 31) & 1)
    return Int32((words[j // 2] >> (15 + 16 * (j % 2))) & 1)


@cute.jit
def _mx_encode(vals: cute.TensorSSA, words: cute.TensorSSA, amax: Int32, out: cute.Tensor,
               vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    """out[q] = four e4m3 codes of x * 2^(127 - byte) packed per word. Ordinary blocks (0 < amax <
    Inf) take the branch-free path; all-zero blocks write 0x00 (-0.0 too); blocks holding NaN/Inf keep
    the same magnitudes (Inf clamps to 448) with NaN lanes rewritten to sign|0x7F."""
    scale = i2f(e8m0_scale_bits(mx_byte(amax)))
    mags = cute.make_rmem_tensor((vec,), Int32)
    for j in range_constexpr(vec):
        mags[j] = e4m3_mag_byte(mul_rn(vals[j], scale))
    for q in range_constexpr(vec // 4):
        out[q] = pack_bytes(mags[4 * q], mags[4 * q + 1], mags[4 * q + 2], mags[4 * q + 3]) | sign_bytes(
            words, q, dtype_name)
    if (amax == 0) | (amax >= F32_INF):
        for q in range_constexpr(vec // 4):
            word = Int32(0)
            for k in range_constexpr(4):
                j = 4 * q + k
                nan = (f2i(vals[j]) & 0x7FFFFFFF) > F32_INF
                code = sel(nan, 0x7F, (mags[j] >> 24) & 0x7F) | (sign_bit(words, j, dtype_name) << 7)
                word = word | (code << (8 * k))
            out[q] = sel(amax == 0, 0, word)


def e8m0_value_bits(b: Int32) -> Int32:
    """fp32 bits of 2^(b-127) for b in [0, 254] (b = 0 is the subnormal 2^-127)."""
    return sel(b == 0, F32_QUIET_BIT, b << 23)


@cute.jit
def _group_max(v: Int32, group: Constexpr[int]) -> Int32:
    off = group // 2
    while const_expr(off > 0):
        v = cutlass_max(v, cute.arch.shuffle_sync_bfly(v, offset=off))
        off = off // 2
    return v


@cute.jit
def _abs_max(vals: cute.TensorSSA, amax: Int32, vec: Constexpr[int]) -> Int32:
    """max(amax, |vals| as fp32 bits) on doubled bits: the doubling (an IMAD) drops the sign bit
    instead of an AND on the ALU pipe, which the encoder keeps busy."""
    twice = Uint32(amax) * 2
    for j in range_constexpr(vec):
        b = Uint32(f2i(vals[j])) * 2
        twice = Uint32(select_(b > twice, b, twice))
    return Int32(twice >> 1)


@cute.jit
def _load_words(gx: Any, i: Int64, vec: Constexpr[int], dtype_name: Constexpr[str]) -> cute.Tensor:
    """Vector i as raw 32-bit words in registers: the encoder needs both the values and their bits."""
    raw: cute.Tensor = cute.make_rmem_tensor((vec * DTYPES[dtype_name].width // 32,), Int32)
    raw.store(gx[(None, i)].load().reshape((vec,)).bitcast(Int32))
    return raw


@cute.kernel
def mx_quant_kernel(px: Pointer, pq: Pointer, ps: Pointer, nvec: Int64, vec: Constexpr[int],
                    group: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    """`group` lanes of one warp hold one block of group*vec elements; their max meets by shuffles.
    Each thread loads QUANT_VECS CTA-strided vectors up front (each warp load stays contiguous); lanes past
    the end re-read the last vector, so the loads need no branch, and store nothing."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    n = nvec * vec
    gx = cute.zipped_divide(cute.make_tensor(px, cute.make_layout(n)), (vec,))
    gq = cute.zipped_divide(cute.make_tensor(pq, cute.make_layout(n)), (vec,))
    ms = cute.make_tensor(ps, cute.make_layout(nvec // group))
    raws = []
    for p in range_constexpr(QUANT_VECS):
        i = (Int64(bidx) * QUANT_VECS + p) * THREADS + Int64(tidx)
        raws.append(_load_words(gx, cutlass_min64(i, nvec - 1), vec, dtype_name))
    for p in range_constexpr(QUANT_VECS):
        i = (Int64(bidx) * QUANT_VECS + p) * THREADS + Int64(tidx)
        words = raws[p].load()
        vals = words.bitcast(DTYPES[dtype_name]).to(Float32)
        amax = _group_max(_abs_max(vals, Int32(0), vec), group)
        out = cute.make_rmem_tensor((vec // 4,), Int32)
        _mx_encode(vals, words, amax, out, vec, dtype_name)
        if i < nvec:
            cute.recast_tensor(gq[(None, i)], Int32).store(out.load())
            if tidx % group == 0:
                ms[i // group] = Uint8(mx_byte(amax))


@cute.jit
def mx_quant_host(px: Pointer, pq: Pointer, ps: Pointer, nvec: Int64, stream: cuda.CUstream,
                  vec: Constexpr[int], group: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    mx_quant_kernel(px, pq, ps, nvec, vec, group, dtype_name).launch(
        grid=[(nvec + THREADS * QUANT_VECS - 1) // (THREADS * QUANT_VECS), 1, 1], block=[THREADS, 1, 1],
        stream=stream, use_pdl=PDL
    )


@cute.kernel
def mxw_quant_kernel(px: Pointer, pq: Pointer, ps: Pointer, rows: Int64, k: Int64, vec: Constexpr[int],
                     dtype_name: Constexpr[str]) -> None:
    """One CTA per 128x128 block (row blocks on the grid's x: y stops at 65535), `tpr` lanes per row.
    Each thread keeps all its vectors in registers: the block's max |x| meets by warp shuffles and shared
    memory, then the same registers are encoded, so the block is read from memory once."""
    await_upstream()
    tpr = WEIGHT_BLOCK // vec
    passes = WEIGHT_BLOCK * tpr // THREADS
    tidx, _, _ = cute.arch.thread_idx()
    by, bx, _ = cute.arch.block_idx()
    kv = k // vec
    gx = cute.zipped_divide(cute.make_tensor(px, cute.make_layout(rows * k)), (vec,))
    gq = cute.zipped_divide(cute.make_tensor(pq, cute.make_layout(rows * k)), (vec,))
    ms = cute.make_tensor(ps, cute.make_layout((rows // WEIGHT_BLOCK) * (k // WEIGHT_BLOCK)))
    first = (Int64(by) * WEIGHT_BLOCK + Int64(tidx // tpr)) * kv + Int64(bx) * tpr + Int64(tidx % tpr)
    step = Int64(THREADS // tpr) * kv
    raws = []
    for p in range_constexpr(passes):
        raws.append(_load_words(gx, first + p * step, vec, dtype_name))
    amax = Int32(0)
    for p in range_constexpr(passes):
        amax = _abs_max(raws[p].load().bitcast(DTYPES[dtype_name]).to(Float32), amax, vec)
    amax = _group_max(amax, 32)
    red = cute.make_tensor(cute.arch.alloc_smem(Int32, THREADS // 32), cute.make_layout(THREADS // 32))
    if tidx % 32 == 0:
        red[tidx // 32] = amax
    cute.arch.sync_threads()
    for w in range_constexpr(THREADS // 32):
        amax = cutlass_max(amax, red[w])
    out = cute.make_rmem_tensor((vec // 4,), Int32)
    for p in range_constexpr(passes):
        words = raws[p].load()
        _mx_encode(words.bitcast(DTYPES[dtype_name]).to(Float32), words, amax, out, vec, dtype_name)
        cute.recast_tensor(gq[(None, first + p * step)], Int32).store(out.load())
    if tidx == 0:
        ms[Int64(by) * (k // WEIGHT_BLOCK) + Int64(bx)] = Uint8(mx_byte(amax))


@cute.jit
def mxw_quant_host(px: Pointer, pq: Pointer, ps: Pointer, rows: Int64, k: Int64, stream: cuda.CUstream,
                   vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    mxw_quant_kernel(px, pq, ps, rows, k, vec, dtype_name).launch(
        grid=[rows // WEIGHT_BLOCK, k // WEIGHT_BLOCK, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def _mx_dequant_vec(gq: Any, gy: Any, i: Int64, b: Int32, vec: Constexpr[int]) -> None:
    """e4m3 value * 2^(b-127); every NaN result is the spec's canonical 0x7FC00000."""
    cv = gq[(None, i)].load().reshape((vec,))
    scale = i2f(e8m0_value_bits(b))
    out = cute.make_rmem_tensor((vec,), Int32)
    for j in range_constexpr(vec):
        c = cv[j].to(Int32) & 0xFF
        r = f2i(mul_rn(i2f(e4m3_value_bits(c)), scale))
        nan = ((c & 0x7F) == 0x7F) | (b == 255) | ((r & 0x7FFFFFFF) > F32_INF)
        out[j] = sel(nan, F32_CANONICAL_NAN, r)
    cute.recast_tensor(gy[(None, i)], Int32).store(out.load())


@cute.kernel
def mx_dequant_kernel(pq: Pointer, ps: Pointer, py: Pointer, nvec: Int64, vec: Constexpr[int],
                      block: Constexpr[int]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    n = nvec * vec
    if i < nvec:
        gq = cute.zipped_divide(cute.make_tensor(pq, cute.make_layout(n)), (vec,))
        gy = cute.zipped_divide(cute.make_tensor(py, cute.make_layout(n)), (vec,))
        ms = cute.make_tensor(ps, cute.make_layout(n // block))
        _mx_dequant_vec(gq, gy, i, ms[i // (block // vec)].to(Int32) & 0xFF, vec)


@cute.jit
def mx_dequant_host(pq: Pointer, ps: Pointer, py: Pointer, nvec: Int64, stream: cuda.CUstream,
                    vec: Constexpr[int], block: Constexpr[int]) -> None:
    mx_dequant_kernel(pq, ps, py, nvec, vec, block).launch(
        grid=[(nvec + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.kernel
def mxw_dequant_kernel(pq: Pointer, ps: Pointer, py: Pointer, rows: Int64, k: Int64,
                       vec: Constexpr[int]) -> None:
    """Grid (rows, column chunks): the scale index needs no division by the dynamic K, and rows, E x N of a
    weight stack, go on x, whose limit is 2^31 - 1, not the 65535 of y."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    row, bx, _ = cute.arch.block_idx()
    kv = k // vec
    cv = Int64(bx) * THREADS + Int64(tidx)
    if cv < kv:
        n = rows * k
        gq = cute.zipped_divide(cute.make_tensor(pq, cute.make_layout(n)), (vec,))
        gy = cute.zipped_divide(cute.make_tensor(py, cute.make_layout(n)), (vec,))
        kb = k // WEIGHT_BLOCK
        ms = cute.make_tensor(ps, cute.make_layout((rows // WEIGHT_BLOCK) * kb))
        b = ms[(Int64(row) // WEIGHT_BLOCK) * kb + cv // (WEIGHT_BLOCK // vec)].to(Int32) & 0xFF
        _mx_dequant_vec(gq, gy, Int64(row) * kv + cv, b, vec)


@cute.jit
def mxw_dequant_host(pq: Pointer, ps: Pointer, py: Pointer, rows: Int64, k: Int64, stream: cuda.CUstream,
                     vec: Constexpr[int]) -> None:
    mxw_dequant_kernel(pq, ps, py, rows, k, vec).launch(
        grid=[rows, (k // vec + THREADS - 1) // THREADS, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.kernel
def nvfp4_amax_kernel(px: Pointer, pamax: Pointer, nvec: Int64, vec: Constexpr[int],
                      dtype_name: Constexpr[str]) -> None:
    """Grid-stride max of finite |x| as fp32 bits, one atomic max per warp (non-negative bits order).
    AMAX_VECS loads issue before any is read; indices past the end re-read the last vector (a max
    ignores repeats), so no branch holds the loads apart."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    gx = cute.zipped_divide(cute.make_tensor(px, cute.make_layout(nvec * vec)), (vec,))
    stride = Int64(gdim) * THREADS
    first = Int64(bidx) * THREADS + Int64(tidx)
    amax = Int32(0)
    for it in cutlass.range((nvec + stride * AMAX_VECS - 1) // (stride * AMAX_VECS)):  # type: ignore[attr-defined]
        xs = []
        for k in range_constexpr(AMAX_VECS):
            i = first + (it * AMAX_VECS + k) * stride
            xs.append(gx[(None, cutlass_min64(i, nvec - 1))].load().reshape((vec,)))
        for k in range_constexpr(AMAX_VECS):
            xv = xs[k].to(Float32)
            for j in range_constexpr(vec):
                a = f2i(xv[j]) & 0x7FFFFFFF
                amax = cutlass_max(amax, sel(a < F32_INF, a, 0))
    amax = _group_max(amax, 32)
    if tidx % 32 == 0:
        cute.arch.atomic_max(pamax, amax)


@cute.jit
def nvfp4_amax_host(px: Pointer, pamax: Pointer, nvec: Int64, ctas: Int32, stream: cuda.CUstream,
                    vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    nvfp4_amax_kernel(px, pamax, nvec, vec, dtype_name).launch(
        grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.kernel
def nvfp4_quant_kernel(px: Pointer, pamax: Pointer, pq: Pointer, ps: Pointer, pg: Pointer, nvec: Int64,
                       vec: Constexpr[int], group: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    """Pinned fp32 order: g = amax/2688; s_b = e4m3((amax_b/6)/g); codes = e2m1(x/(s_b*g)), `group` lanes
    per 16-element block; NaN/Inf blocks get scale 0x7F and codes 0. Each thread takes QUANT_VECS vectors
    as mx_quant does (loads first, index clamped), sharing g and the index math between them."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    n = nvec * vec
    gx = cute.zipped_divide(cute.make_tensor(px, cute.make_layout(n)), (vec,))
    gq = cute.zipped_divide(cute.make_tensor(pq, cute.make_layout(n // 2)), (vec // 2,))
    ms = cute.make_tensor(ps, cute.make_layout(n // NVFP4_BLOCK))
    xs = []
    for p in range_constexpr(QUANT_VECS):
        i = (Int64(bidx) * QUANT_VECS + p) * THREADS + Int64(tidx)
        xs.append(gx[(None, cutlass_min64(i, nvec - 1))].load().reshape((vec,)))
    g = div_rn(i2f(cute.make_tensor(pamax, cute.make_layout(1))[0]), 448.0 * 6.0)
    for p in range_constexpr(QUANT_VECS):
        i = (Int64(bidx) * QUANT_VECS + p) * THREADS + Int64(tidx)
        xf = xs[p].to(Float32)
        amax = Int32(0)
        for j in range_constexpr(vec):
            amax = cutlass_max(amax, f2i(xf[j]) & 0x7FFFFFFF)
        amax = _group_max(amax, group)
        bad = sel(amax < F32_INF, 0, 1)
        s_real = div_rn(div_rn(i2f(amax), 6.0), g)
        s_code = sel(f2i(g) > 0, e4m3_mag(f2i(s_real)), 0)
        denom = mul_rn(i2f(e4m3_value_bits(s_code)), g)
        ok = (bad == 0) & (f2i(denom) > 0)
        safe = i2f(sel(ok, f2i(denom), F32_ONE))
        codes = cute.make_rmem_tensor((vec,), Int32)
        for j in range_constexpr(vec):
            mag = e2m1_mag(f2i(div_rn(xf[j], safe)) & 0x7FFFFFFF)
            codes[j] = sel(ok, mag | sel(f2i(xf[j]) < 0, 8, 0), 0)
        packed = cute.make_rmem_tensor((vec // 2,), Uint8)
        for j in range_constexpr(vec // 2):
            packed[j] = Uint8(codes[2 * j] | (codes[2 * j + 1] << 4))
        if i < nvec:
            gq[(None, i)].store(packed.load())
            if tidx % group == 0:
                ms[i // group] = Uint8(sel(bad == 0, s_code, 0x7F))
            if i == 0:
                cute.make_tensor(pg, cute.make_layout(1))[0] = g


@cute.jit
def nvfp4_quant_host(px: Pointer, pamax: Pointer, pq: Pointer, ps: Pointer, pg: Pointer, nvec: Int64,
                     stream: cuda.CUstream, vec: Constexpr[int], group: Constexpr[int],
                     dtype_name: Constexpr[str]) -> None:
    nvfp4_quant_kernel(px, pamax, pq, ps, pg, nvec, vec, group, dtype_name).launch(
        grid=[(nvec + THREADS * QUANT_VECS - 1) // (THREADS * QUANT_VECS), 1, 1], block=[THREADS, 1, 1],
        stream=stream, use_pdl=PDL
    )


@cute.kernel
def nvfp4_dequant_kernel(pq: Pointer, ps: Pointer, pg: Pointer, py: Pointer, nblk: Int64) -> None:
    """One thread per 16-element block. NaN bits as torch on x86 gives them: the tensor scale's NaN
    wins, then the block scale's, and 0 * Inf is 0xFFC00000."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    if i < nblk:
        n = nblk * NVFP4_BLOCK
        gq = cute.zipped_divide(cute.make_tensor(pq, cute.make_layout(n // 2)), (NVFP4_BLOCK // 2,))
        gy = cute.zipped_divide(cute.make_tensor(py, cute.make_layout(n)), (NVFP4_BLOCK,))
        s = cute.make_tensor(ps, cute.make_layout(nblk))[i].to(Int32) & 0xFF
        g = cute.make_tensor(pg, cute.make_layout(1))[0]
        gb = f2i(g)
        ga = gb & 0x7FFFFFFF
        sv = i2f(e4m3_value_bits(s))
        pv = gq[(None, i)].load().reshape((NVFP4_BLOCK // 2,))
        out = cute.make_rmem_tensor((NVFP4_BLOCK,), Int32)
        for j in range_constexpr(NVFP4_BLOCK):
            c = ((pv[j // 2].to(Int32) & 0xFF) >> (4 * (j % 2))) & 0xF
            prod = mul_rn(i2f(e2m1_value_bits(c)), sv)
            r = f2i(mul_rn(prod, g))
            nan = ((s & 0x7F) == 0x7F) | (ga > F32_INF) | ((r & 0x7FFFFFFF) > F32_INF)
            out[j] = sel(nan, F32_CANONICAL_NAN, r)
        cute.recast_tensor(gy[(None, i)], Int32).store(out.load())


@cute.jit
def nvfp4_dequant_host(pq: Pointer, ps: Pointer, pg: Pointer, py: Pointer, nblk: Int64,
                       stream: cuda.CUstream) -> None:
    nvfp4_dequant_kernel(pq, ps, pg, py, nblk).launch(
        grid=[(nblk + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


def pointer(dtype_name: str, address: int, align: int) -> Any:
    dtype = {**DTYPES, "uint8": Uint8, "int32": Int32}[dtype_name]
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


# Per kernel: host function, (dtype name, alignment) of each pointer, type of each scalar, and the
# Constexpr specialisation keys, in argument order. The dtype "x" stands for the input's dtype.
SIGNATURES: dict[str, tuple[Any, tuple[tuple[str, int], ...], tuple[Any, ...], tuple[str, ...]]] = {
    "mx_quant": (mx_quant_host, (("x", 16), ("uint8", -1), ("uint8", 1)), (Int64,),
                 ("vec", "group", "dtype_name")),
    "mxw_quant": (mxw_quant_host, (("x", 16), ("uint8", -1), ("uint8", 1)), (Int64, Int64),
                  ("vec", "dtype_name")),
    "mx_dequant": (mx_dequant_host, (("uint8", 8), ("uint8", 1), ("float32", 16)), (Int64,),
                   ("vec", "block")),
    "mxw_dequant": (mxw_dequant_host, (("uint8", 8), ("uint8", 1), ("float32", 16)), (Int64, Int64),
                    ("vec",)),
    "nvfp4_amax": (nvfp4_amax_host, (("x", 16), ("int32", 4)), (Int64, Int32), ("vec", "dtype_name")),
    "nvfp4_quant": (nvfp4_quant_host, (("x", 16), ("int32", 4), ("uint8", -2), ("uint8", 1), ("float32", 4)),
                    (Int64,), ("vec", "group", "dtype_name")),
    "nvfp4_dequant": (nvfp4_dequant_host, (("uint8", 8), ("uint8", 1), ("float32", 4), ("float32", 16)),
                      (Int64,), ()),
}


def pointers(kernel: str, addresses: tuple[int, ...], spec: dict[str, Any]) -> list[Any]:
    """Typed pointers; alignment -1 means `vec` bytes (one code per element), -2 means vec/2 (packed)."""
    out = []
    for (name, align), address in zip(SIGNATURES[kernel][1], addresses, strict=True):
        dtype_name = spec["dtype_name"] if name == "x" else name
        nbytes = {-1: spec.get("vec", 0), -2: spec.get("vec", 0) // 2}.get(align, align)
        out.append(pointer(dtype_name, address, nbytes))
    return out


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Host function and fake arguments (null pointers, zero sizes) that compile `kernel` without a GPU."""
    host, ptrs, scalars, consts = SIGNATURES[kernel]
    fake = pointers(kernel, tuple(0 for _ in ptrs), spec)
    return host, (*fake, *(t(0) for t in scalars), cuda.CUstream(0), *(spec[c] for c in consts))
