"""Scale factors in the byte order tcgen05 block-scaled MMA reads, packed by torch from row-major scales.

Torch-only (import-safe without cutlass); every packer runs on the scales' device without a host sync.
"""

# Layout. The MMA consumes scales in 512-byte atoms of 128 rows x 4 scale columns (one column = one K block
# of 32 for MXFP8, 16 for NVFP4). Inside an atom, scale (r, c) sits at byte (r % 32) * 16 + (r // 32) * 4 + c.
# Atoms go K-block-atom fastest, then 128-row block, then batch (expert) index:
#
#     offset(r, c, l) = ((l * RB + r // 128) * CB + c // 4) * 512
#                       + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
#
# with RB = ceil(rows / 128) and CB = ceil(cols / 4), or more where the kernel pads K to whole k-tiles
# (COLS_MULTIPLE); padding bytes are zero. This is CuTe's `tile_atom_to_shape_SF` layout (the tests check it
# against the DSL). Activation rows are grouped by expert and groups are not 128-row aligned, so activation
# scales use a group-padded variant: group e's rows start at row block blk_e = sum_{j<e} ceil(count_j / 128)
# (padded row 128 * blk_e) and the kernel asks for block blk_e + m_tile. Rows past offs[-1] are dropped.

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.constants import FP8_WEIGHT_BLOCK, MXFP8_BLOCK_SM100
from nmoe.fast.limits import SF_COLS, SF_ROWS

# Scale columns per kernel k-tile (tile K / scale block): MXFP8 128/32, NVFP4 256/16.
COLS_MULTIPLE = {"mxfp8": 4, "nvfp4": 16}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def grouped_row_blocks(m: int, n_groups: int) -> int:
    """Static capacity in 128-row blocks of the group-padded activation scales: sum ceil(c_e/128) <= this."""
    return _ceil(m, SF_ROWS) + n_groups


def _pad(scales: Tensor, rows: int, cols: int) -> Tensor:
    r, c = scales.shape[-2:]
    if (r, c) == (rows, cols):
        return scales
    out = scales.new_zeros(*scales.shape[:-2], rows, cols)
    out[..., :r, :c] = scales
    return out


def pack_atoms(scales: Tensor, cols_multiple: int = SF_COLS) -> Tensor:
    """[..., R, C] uint8 scales -> flat uint8 in atom order, batch dims outer; R, C zero-padded up."""
    if scales.dtype != torch.uint8:
        raise ValueError(f"pack_atoms: scales must be uint8 bit patterns (e8m0 / e4m3), got {scales.dtype}; "
                         "pass .view(torch.uint8) of the scale tensor")
    if scales.dim() < 2:
        raise ValueError(f"pack_atoms: need [..., rows, cols] scales, got shape {tuple(scales.shape)}")
    if cols_multiple % SF_COLS:
        raise ValueError(f"pack_atoms: cols_multiple {cols_multiple} must be a multiple of {SF_COLS}")
    r, c = scales.shape[-2:]
    rb, cb = _ceil(r, SF_ROWS), _ceil(c, cols_multiple) * (cols_multiple // SF_COLS)
    lead = scales.shape[:-2]
    p = _pad(scales, rb * SF_ROWS, cb * SF_COLS)
    # [..., rb, r1, r0, cb, c0] -> [..., rb, cb, r0, r1, c0] with r = rb*128 + r1*32 + r0, c = cb*4 + c0
    p = p.reshape(*lead, rb, SF_ROWS // 32, 32, cb, SF_COLS)
    n = len(lead)
    perm = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return p.permute(perm).reshape(-1).contiguous()


def clamped_ends(offs: Tensor, m: int) -> Tensor:
    """Group row ends as the kernel reads them: offs forced non-decreasing and into [0, m] (int64)."""
    return torch.cummax(offs.to(torch.int64).clamp_min(0), dim=0).values.clamp_max(m)


def pack_grouped_rows(scales: Tensor, offs: Tensor, cols_multiple: int = SF_COLS) -> Tensor:
    """[M, C] activation scales + int32 cumulative group ends -> group-padded atoms (grouped_row_blocks)."""
    if scales.dim() != 2:
        raise ValueError(f"pack_grouped_rows: need [M, cols] scales, got shape {tuple(scales.shape)}")
    m, c = scales.shape
    n_groups = offs.numel()
    cap = grouped_row_blocks(m, n_groups) * SF_ROWS
    buf = scales.new_zeros(cap + m, c)
    if n_groups and m:
        ends = clamped_ends(offs, m)
        starts = torch.cat((ends.new_zeros(1), ends[:-1]))
        blocks = (ends - starts + (SF_ROWS - 1)) // SF_ROWS
        first_blk = torch.cumsum(blocks, 0) - blocks
        rows = torch.arange(m, device=scales.device, dtype=torch.int64)
        group = torch.searchsorted(ends, rows, right=True)
        g = group.clamp_max(n_groups - 1)
        dest = first_blk[g] * SF_ROWS + rows - starts[g]
        # Rows past the last group end go to private spill rows past `cap` (distinct indices: deterministic).
        dest = torch.where(group < n_groups, dest, cap + rows)
        buf.index_copy_(0, dest, scales)
    return pack_atoms(buf[:cap], cols_multiple)


def expand_fp8_act_scales(xs: Tensor) -> Tensor:
    """1x128 e8m0 activation scales [M, K/128] -> the equal 1x32 MX scales [M, K/32] (exact: bytes repeat)."""
    return xs.repeat_interleave(FP8_WEIGHT_BLOCK // MXFP8_BLOCK_SM100, dim=-1)


def expand_fp8_weight_scales(ws: Tensor) -> Tensor:
    """128x128 e8m0 weight scales [E, N/128, K/128] -> the equal 1x32 MX scales [E, N, K/32]."""
    rows = ws.repeat_interleave(FP8_WEIGHT_BLOCK, dim=-2)
    return rows.repeat_interleave(FP8_WEIGHT_BLOCK // MXFP8_BLOCK_SM100, dim=-1)
