"""Format and tokenizer constants shared by the spec (nmoe.reference) and the fast path (nmoe.fast).

Lives outside both packages so the fast path never imports the reference to learn a number.
"""

from __future__ import annotations

from typing import Final

E4M3_MAX: Final[float] = 448.0
E2M1_MAX: Final[float] = 6.0
E2M1_VALUES: Final[tuple[float, ...]] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

E8M0_BIAS: Final[int] = 127
E8M0_MIN_BYTE: Final[int] = 1
E8M0_MAX_BYTE: Final[int] = 254
E8M0_NAN: Final[int] = 255

BF16_CANONICAL_NAN: Final[int] = 0x7FC0
F32_CANONICAL_NAN: Final[int] = 0x7FC00000
"""The one NaN the spec writes: payloads differ across CPUs, GPUs and vector paths."""

MXFP8_BLOCK_SM100: Final[int] = 32
MXFP8_BLOCK_SM90: Final[int] = 128
FP8_WEIGHT_BLOCK: Final[int] = 128
NVFP4_BLOCK: Final[int] = 16
MX_BLOCKS: Final[tuple[int, ...]] = (MXFP8_BLOCK_SM100, MXFP8_BLOCK_SM90)

ACT_H_COLUMNS: Final[dict[str, int]] = {"swiglu": 2, "relu2": 1}
"""h columns per act(h) column of each expert activation: swiglu's interleaved (gate, up) pairs, relu2 one."""

O200K_HARMONY: Final[str] = "o200k_harmony"
O200K_HARMONY_VOCAB: Final[int] = 201088
