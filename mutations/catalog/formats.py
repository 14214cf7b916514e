"""mxfp8.*, nvfp4.*, e2m1.*, e4m3.*: defects in the bit-exact number formats (nmoe/reference/formats.py)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/formats.py"
TESTS = "tests/test_formats.py"


def _ties_away(call: str, ebits: int, mbits: int, bias: int, max_code: int) -> str:
    """RNE result, bumped one code up wherever the input sat exactly halfway and RNE rounded down."""
    dec = f"ebits={ebits}, mbits={mbits}, bias={bias}"
    return (
        f"{call}\n"
        f"    _a = torch.clamp(xf.abs(), max=vmax_).double()\n"
        f"    _lo = _decode_minifloat(mag, {dec}).double()\n"
        f"    _hi = _decode_minifloat((mag + 1).clamp(max={max_code}), {dec}).double()\n"
        f"    mag = torch.where((_a == (_lo + _hi) / 2) & (_lo < _a), mag + 1, mag)"
    )


E4M3_CALL = '    sign, mag, nan = _encode_minifloat(_f32(x, "e4m3_encode"), mbits=3, emin=-6, vmax=E4M3_MAX)'
E2M1_CALL = "    sign, mag, _ = _encode_minifloat(xf, mbits=1, emin=0, vmax=E2M1_MAX)"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "mxfp8.scale_floor_not_ceil", FILE,
        "    byte = ((bits >> _F32_MANT) & 0xFF) + ((bits & ((1 << _F32_MANT) - 1)) != 0).to(torch.int64)",
        "    byte = (bits >> _F32_MANT) & 0xFF",
        "MX scale byte = floor(log2(amax/448)) instead of ceil: the block max overflows e4m3", TESTS,
        ("quantize_mxfp8",),
    ),
    sep_mutation(
        "mxfp8.no_clamp", FILE,
        "    byte = torch.clamp(byte, 1, 254)\n",
        "",
        "MX scale byte not clamped to [1, 254]: an all-zero block gets byte 0", TESTS, ("quantize_mxfp8",),
    ),
    sep_mutation(
        "nvfp4.block_32_not_16", FILE,
        "MX_BLOCKS, NVFP4_BLOCK\n",
        "MX_BLOCKS\n\nNVFP4_BLOCK = 32\n",
        "NVFP4 block scales over 32 elements (the MX block) instead of 16", TESTS, ("quantize_nvfp4",),
    ),
    sep_mutation(
        "nvfp4.scale_round_up", FILE,
        "    s_code = e4m3_encode(torch.clamp(s_real, 0.0, E4M3_MAX))\n",
        "    s_code = e4m3_encode(torch.clamp(s_real, 0.0, E4M3_MAX))\n"
        "    s_code = torch.where(e4m3_decode(s_code) < s_real, s_code + 1, s_code)\n",
        "NVFP4 block scale rounded up to the next e4m3 code instead of RNE", TESTS, ("quantize_nvfp4",),
    ),
    sep_mutation(
        "e2m1.ties_away", FILE,
        E2M1_CALL,
        _ties_away(E2M1_CALL, 2, 1, 1, 7).replace("vmax_", "E2M1_MAX"),
        "e2m1 rounds exact ties away from zero instead of to even", TESTS, ("quantize_nvfp4",),
    ),
    sep_mutation(
        "e4m3.ties_away", FILE,
        E4M3_CALL,
        '    xf = _f32(x, "e4m3_encode")\n'
        + _ties_away(E4M3_CALL, 4, 3, 7, 0x7E).replace("vmax_", "E4M3_MAX"),
        "e4m3 rounds exact ties away from zero instead of to even", TESTS, ("quantize_mxfp8",),
    ),
    sep_mutation(
        "e4m3.nan_sign_dropped", FILE,
        "    mag = torch.where(nan, torch.full_like(mag, 0x7F), mag)\n",
        "    mag = torch.where(nan, torch.full_like(mag, 0x7F), mag)\n"
        "    sign = torch.where(nan, torch.zeros_like(sign), sign)\n",
        "e4m3 writes every NaN as 0x7F, dropping the sign the spec keeps (-NaN -> 0xFF)", TESTS,
        ("quantize_mxfp8",),
    ),
    sep_mutation(
        "nvfp4.amax_includes_nonfinite", FILE,
        "    amax = xf.abs().where(torch.isfinite(xf), torch.zeros_like(xf)).amax()"
        " if xf.numel() else xf.new_zeros(())",
        "    amax = xf.abs().nan_to_num(nan=0.0, posinf=float(\"inf\")).amax()"
        " if xf.numel() else xf.new_zeros(())",
        "NVFP4 tensor scale from a max that counts Inf: one Inf makes g Inf and zeroes every block", TESTS,
        ("quantize_nvfp4",),
    ),
)
