"""Sizes the kernels are built around and the glue checks against: one home, no cutlass import.

Kernel modules and torch glue both read these, so a check can never drift from the kernel it guards.
"""

from __future__ import annotations

from typing import Final

VEC_BYTES: Final[int] = 16
"""Widest global access (128-bit); a pointer aligned to it lets a kernel move whole vectors."""

MAX_EXPERTS: Final[int] = 1024
"""Experts the router and dispatch kernels hold per-expert state for in shared memory."""
MAX_RANKS: Final[int] = 32
"""Ranks of an RDEP group: one warp of its sync kernel awaits one flag per rank."""
ROUTER_MAX_K: Final[int] = 32
ROUTER_MAX_GROUPS: Final[int] = 32

FAST_PDL: Final[bool] = False
"""Programmatic dependent launch: every fast kernel is launched so it may start while the one before it ends,
and waits (griddepcontrol.wait) as its first step, so its launch hides under that tail; for the ~0.2-0.3 ms
outside kernels in each graphed MoE layer step (H100, fa0c04f). Off: H100 layer fwd and fwd+bwd 0.98-1.03x
against its baseline's 0.99-1.01x (c251dcb, ablate.layer_pdl); moonlet's step (ablate.step_pdl) untimed."""

GEMM_BM: Final[int] = 128
"""M tile of every grouped GEMM (sm_90a and sm_100a): groups are padded to it in tile counts."""
GEMM_BK: Final[int] = 64
"""K box of the sm_90a grouped GEMMs (rows of the wgrad's reduction): its row splits are multiples of it."""
GEMM_BN_CHOICES: Final[tuple[int, ...]] = (128, 256)
GEMM_PINGPONG_MAX_K: Final[int] = 1024
"""sm_90a TMA-fed fwd/dgrad: ping-pong (each consumer warpgroup its own BM x pingpong_bn(act) tile, one's
epilogue under the other's MMAs) up to this reduction K, cooperative (both on one BM x bn tile) above: the
shorter K, the larger the epilogue's share (H200: 1.01-1.34x at K <= 1024, 0.92-1.02x above)."""
GEMM_GATHER_PINGPONG: Final[bool] = False
"""Ping-pong for the fwd/dgrad that gather A row by row (any K), whose producer is their pace: a ping-pong
tile is pingpong_bn(act) wide, so each A row is gathered more often than in a 256-wide cooperative one
(H200, 128-wide: 0.61-0.99x)."""
GEMM_PINGPONG_BN: Final[int] = 192
"""N tile of a ping-pong warpgroup (a 192-register accumulator, no spills): 1.5x the MMAs per A box of 128
(H100 downs 1.00-1.16x, layer fwd 1.04-1.06x at H = 4096, I = 1024; N = 4096 pads its last tile)."""
GEMM_PINGPONG_ACT_BN: Final[int] = 128
"""The same with a fused activation epilogue: at 192 ptxas spills 236 bytes in the swiglu one."""
GEMM_CLUSTER_M: Final[int] = 2
"""CTAs of an sm_90a TMA-fed fwd/dgrad cluster: they take M tiles side by side and share each B box by TMA
multicast, so B's L2 reads are cut by this factor."""
GEMM_A_EVICT_FIRST: Final[bool] = False
"""The TMA-fed fwd/dgrad's (bf16 and fp8) A TMAs mark A's rows first to leave L2: one M tile's rows serve its
N tiles at once."""
GEMM_B_EVICT_LAST: Final[bool] = False
"""The TMA-fed fwd/dgrad's B TMAs mark the expert's weights last to leave L2 (as GEMM_GATHER_B_EVICT_LAST)."""
GEMM_GATHER_B_EVICT_LAST: Final[bool] = False
"""The gathering fwd/dgrad's B TMAs mark the expert's weights last to leave L2: each of the expert's M tiles
reads its B boxes again (H100, static schedule: gathered ups and dgrad 0.98-1.02x,
ablate.gather_b_evict_last)."""
GEMM_WGRAD_DYNAMIC: Final[bool] = True
"""sm_90a TMA-fed wgrad: each CTA takes its next tile of the heaviest-first list from a device counter (a
skewed routing's heavy tiles then spread like a greedy schedule) when True, else in static snake rounds
(H200, MoE layer fwd+bwd: Zipf 1.01-1.03x, uniform 0.99-1.00x over static)."""
GEMM_WGRAD_GATHER_DY_MAX_K: Final[int] = 256
"""The MoE layer's down wgrad (dy = dout's token rows on the 128-wide M side, x = a, K = I wide) reads dout's
rows by index as it loads when I is at most this, else the TMA wgrad reads permuted copies of dout's column
chunks: the copy's 4RH bytes weigh more against 2RHI FLOPs the smaller I (H100 layer fwd+bwd, 002f283:
1.07x at I = 256, 1.00x at 512, 0.97-0.98x at 1024; at 26d6355 the copies ran 0.93x at I = 256)."""
GEMM_DGRAD_SPILL: Final[bool] = True
"""Where the MoE layer's down wgrad reads a permuted copy of dout (I above GEMM_WGRAD_GATHER_DY_MAX_K), the
gathered down dgrad writes that copy whole from the rows it gathered (box kt from N tile kt % n_tiles)
instead of a pass copying column chunks after it: 2RH bytes held until the wgrad, peak unchanged at c1 and c3.
H100 layer fwd+bwd at 563ceba, two runs: c3 0.975-0.990x, c1 0.975-1.011x (boxes spread: 1.00x, fa0c04f)."""
GEMM_WGRAD_GATHER_X_MAX_N: Final[int] = 512
"""The MoE layer's up wgrad (x = the token rows, dy = dh, N = its width: 2I swiglu, I relu2) reads x's rows
by index as it loads when N is at most this, else the TMA wgrad reads permuted copies of x's column chunks:
the copies' 4RH bytes weigh more against 2RNH FLOPs the smaller N. H100 layer fwd+bwd, x gathered on M at
563ceba: 0.93-0.97x at N = 512 (c2), 1.00-1.02x at 1024 (c3), 1.07x at 2048 (c1)."""
GEMM_WGRAD_GATHER_X_ON_M: Final[bool] = True
"""Where the up wgrad gathers x, x's rows sit on the wgrad's M side (H: 128 rows a tile) against dh's
256-wide N tiles, half the gathered reads per FLOP of x on N, and dw leaves by a transposed TMA store
(SonicMoE's layout): c2 layer fwd+bwd 3.998 / 4.031 ms (uniform / Zipf) against x on N's 4.103 / 4.161
(H100, 563ceba); at c1 9.84 / 9.76 ms (as is / transposed) against x on N's 10.24 (H100, 134b8b4)."""
GEMM_WGRAD_GATHER_DYNAMIC: Final[bool] = False
"""The gathered wgrad takes each tile of its heaviest-first list from a device counter (as GEMM_WGRAD_DYNAMIC
does for the TMA-fed one; producer warp 0 hands it to the other three and the consumers), so the CTAs on one
expert stay together rather than drifting apart over static snake rounds: the gathering fwd's L2 hits rose
from 15% to 65% that way (GEMM_GATHER_DYNAMIC). Lean producer only. Off: H100 ablate.gather_wgrad_dynamic
(134b8b4) 1.13x / 1.02x / 1.04x at c1 (x on N / on M / transposed), 0.97-0.99x at c3."""
GEMM_WGRAD_GATHER_LEAN: Final[bool] = True
"""The gathered wgrad's producer copies a chunk with a 32-bit token shuffle, one wide multiply-add and a
constant shared offset (produce_wgrad_lean) instead of 64-bit shuffles, selects and a swizzle per chunk: under
ncu (H100, c1 up wgrad x on M) the producer ran 1.58x SonicMoE's instructions, and time tracked that ratio."""
GEMM_WGRAD_CLUSTER_M: Final[int] = 1
"""CTAs of an sm_90a TMA-fed wgrad cluster (up to this, where dw's M tiles fill them): one work item's M tiles
side by side, each x box multicast to them, CTA 0 handing each dynamic item to the rest (H200 ncu, c1 up
wgrad: L2 71% busy, dense mm 55%). Off: H100 per wgrad two 0.97-1.08x, four 0.88-1.06x; layer 0.98-1.02x
(and 0.98-1.02x again at eda3506); H200 per wgrad two 0.98-1.06x (median 1.03)."""
GEMM_WGRAD_DEFERRED: Final[bool] = False
"""sm_90a TMA-fed wgrad: a tile's bf16 result waits in registers and leaves one subtile per K box of the next
tile, under its wgmmas, instead of before them (without any epilogue the wgrad ran 1.06-1.18x on the H200).
Off: H200 ablate.wgrad_deferred 0.98-1.10x (median 1.009) per wgrad, MoE layer fwd+bwd 0.97-1.03x."""
GEMM_FWD_DEFERRED: Final[bool] = True
"""The same for the cooperative TMA-fed fwd and dgrad (K above the ping-pong's), act(h) of a fused activation
computed from the held h as each subtile leaves (H200 ablate.fwd_stored_first: fwd 1.015-1.068x, dgrad
1.00-1.04x over storing each tile before the next starts)."""
GEMM_FWD_DYNAMIC: Final[bool] = False
"""The TMA-fed fwd and dgrad (cooperative and ping-pong) take each unit from a device counter as CTAs free up,
as the gathering ones do (GEMM_GATHER_DYNAMIC); off until measured."""
GEMM_GATHER_DEFERRED: Final[bool] = False
"""The same for the fwd and dgrad that gather A row by row (the MoE layer's up projection with its fused
activation, and its down projection's dgrad), cooperative at every K, so nothing else overlaps their
epilogue. Off: H200 MoE layer fwd 1.00-1.01x, fwd+bwd 1.00-1.01x (ablate.layer_gather_deferred)."""
GEMM_GATHER_LAG: Final[int] = 1
"""Stages a gathering producer's cp.async copies stay in flight before it lands them (1 to stages - 2): each
one more is a landed stage fewer for the consumers to run ahead on. H100 c2 (4 stages), 1 against 2: gathered
wgrad 1.38x x on N, 1.22-1.25x x on M; gathering fwd/dgrad 0.99-1.01x (c251dcb; ablate.gather_lag_two)."""
GEMM_GATHER_DYNAMIC: Final[bool] = True
"""The gathering fwd/dgrad take each unit from a device counter, in order, as CTAs free up, instead of every
SM-count-th, so CTAs sharing an expert's B boxes start together however far their static shares drifted.
H100 ncu, c3 up under router-uniform routing: 3.98 ms, 5.4 GB of DRAM reads at 65% L2 hits against static
6.98 ms, 18.5 GB at 15% (ablate.gather_static, ablate.layer_gather_static)."""
GEMM_FP8_OVERLAP: Final[bool] = True
"""sm_90a fp8 fwd: each K block's wgmmas stay in flight while the block before is promoted (two block
accumulators, K loop unrolled) when True, else each block's MMAs are waited before its promotion
(H200: 1.05-1.27x over the serial schedule)."""
GEMM_FP8_STAGED_TILE: Final[bool] = True
"""sm_90a fp8 fwd: stage a whole 128 x 128 output tile (one operand stage less), so its stores drain under
the next tile's MMAs, when True, else two subtiles (H200: down projections 1.047-1.053x, up 0.99-1.00x)."""
GEMM_FP8_TILE_AT_ONCE: Final[bool] = True
"""sm_90a fp8 fwd with a staged tile: all its subtiles staged, then one barrier and their TMA stores, two
consumer barriers a tile instead of two a subtile (H200: downs 1.02-1.13x, ups 0.94-1.01x, against the
two baseline runs' mean). Staggering the warpgroups' stores a K block apart instead lost (downs 0.86-1.09x,
Zipf downs 0.86-0.97x) and was removed; with no epilogue at all the downs ran 1.18-1.62x."""
GEMM_FP8_CLUSTER_M: Final[int] = 2
"""sm_90a fp8 fwd at K <= GEMM_FP8_CLUSTER_MAX_K: CTAs per M cluster, each loading 1/this of the B box for all
(multicast); 1: CTAs alone."""
GEMM_FP8_CLUSTER_MAX_K: Final[int] = 1024
"""Reduction K up to which the fp8 fwd runs in M clusters (H200 at cluster 2 over CTAs alone: downs at K = 256
/ 512 / 1024 1.05 / 1.04 / 1.01x uniform, 1.07 / 0.98 / 1.02x Zipf; ups at K = 1536 / 4096 0.90-0.97x)."""
GEMM_MAX_GROUPS: Final[int] = 1024
"""Groups the grouped GEMM's shared-memory offs table holds."""
GEMM_ALIGN: Final[int] = 8
"""bf16 elements per 16-byte TMA row stride."""

SF_ROWS: Final[int] = 128
SF_COLS: Final[int] = 4
"""sm_100a block-scaled MMA reads scales in atoms of SF_ROWS rows x SF_COLS K blocks."""


def pingpong_bn(act: str) -> int:
    """N tile of a ping-pong warpgroup whose epilogue applies `act` ("none": the plain GEMM)."""
    return GEMM_PINGPONG_BN if act == "none" else GEMM_PINGPONG_ACT_BN
