"""The sm_90a bf16 grouped GEMMs' kernel declarations and compile contracts: which instructions each
representative kernel's PTX must hold and must not, checked without a GPU by nmoe.fast.compilecheck (CI) and
the parity report; the glue (nmoe.fast.gemm.sm90) launches the kernels and re-exports KERNELS."""

from __future__ import annotations

from nmoe.fast._swiglu import quotient_rules
from nmoe.fast.limits import pingpong_bn
from nmoe.fast.op import Kernel
from nmoe.fast.runtime import KernelSpec

ARCH = "sm_90a"
_FWD_MODULE = "nmoe.fast.kernels.sm90.grouped_gemm"
FWD = Kernel(_FWD_MODULE, "grouped_gemm_fwd",
             lambda km, n, k, bn, act, pingpong=False, deferred=False, dynamic=False:
                 km.compile_args(n, k, bn, True, act, pingpong, deferred, dynamic),
             (ARCH,), "nmoe.fast.gemm.grouped_gemm")
DGRAD = Kernel(_FWD_MODULE, "grouped_gemm_dgrad",
               lambda km, n, k, bn, pingpong=False, deferred=False, dynamic=False:
                   km.compile_args(n, k, bn, False, "none", pingpong, deferred, dynamic),
               (ARCH,), "nmoe.fast.gemm.grouped_gemm_dgrad")
GATHER = Kernel("nmoe.fast.kernels.sm90.grouped_gemm_gather", "grouped_gemm_gather",
                lambda km, n, k, bn, act, w_k_major, pingpong=False, keep_h=True, deferred=False,
                dynamic=False, spill=False: km.compile_args_gather(n, k, bn, act, w_k_major, pingpong, keep_h,
                                                                   deferred, dynamic, spill),
                (ARCH,), "nmoe.fast.gemm.grouped_gemm_act_gathered")
WGRAD = Kernel("nmoe.fast.kernels.sm90.grouped_gemm_wgrad", "grouped_gemm_wgrad",
               lambda km, n, k, bn, ld, gs=0, dynamic=False, accumulate=False, deferred=False, cm=1:
                   km.compile_args(n, k, bn, ld, gs, dynamic, accumulate, deferred, cm),
               (ARCH,),
               "nmoe.fast.gemm.grouped_gemm_wgrad")
WGRAD_GATHER = Kernel("nmoe.fast.kernels.sm90.grouped_wgrad_gather", "grouped_gemm_wgrad_gather",
                      lambda km, n, k, bn, side, top_k, accumulate=False, transposed=False, dynamic=False:
                          km.compile_args_gather(n, k, bn, side, top_k, accumulate, transposed, dynamic),
                      (ARCH,),
                      "nmoe.fast.gemm.grouped_gemm_wgrad_gathered")


def pick_bn(n: int) -> int:
    """Wide N tiles halve the A re-reads; they need N to fill them."""
    return 256 if n % 256 == 0 else 128


# Hopper tensor-core MMA fed by the TMA engine; 128-bit epilogue stores; setmaxnreg for the producer/consumer
# split; local memory would mean spilled accumulators.
_STMATRIX, _ST_V4 = r"\bstmatrix\.sync", r"\bst\.global\.v4\.b32\b"
_EXPECT_SM90 = (r"\.target sm_90a\b", r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16",
                r"cp\.async\.bulk\.tensor", _ST_V4, r"\bsetmaxnreg\.inc", _STMATRIX)
_FORBID_SM90 = (r"\b(ld|st)\.local\b", r"\bmma\.sync\b")


def _multicast(dims: int) -> tuple[str, ...]:
    """A cluster sharing a dims-D TMA box: the multicast load, the cluster barrier, the remote stage
    release."""
    return (rf"cp\.async\.bulk\.tensor\.{dims}d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::"
            r"bytes\.multicast::cluster", r"\bbarrier\.cluster\.wait\b",
            r"\bmbarrier\.arrive\.shared::cluster\.b64\b")


# The TMA-fed fwd and dgrad run in clusters of GEMM_CLUSTER_M CTAs that share each B box by TMA multicast.
_CLUSTER = _multicast(3)


# wgrad zeroes the rows of its last box that belong to the next group with ordinary 16-byte stores (scalar
# ones cost the Zipf rows up to a fifth), which the tensor cores may read only after an async-proxy fence.
# A split group's chunks publish fp32 partials, then count in with a device-scope acq_rel atomic.
_EXPECT_WGRAD = (*_EXPECT_SM90, r"\bfence\.proxy\.async\.shared::cta\b", r"\bfence\.acq_rel\.gpu\b",
                 r"\batom\.global\.acq_rel(\.gpu)?\.add\.u32\b",
                 r"\bst\.shared\.v4\.b32\s+\[[^\]]+\],\s*\{0, 0, 0, 0\}")
# An accumulating wgrad adds each full tile by TMA reduce-add and each cut one by loading dw's 16-byte chunk,
# adding in fp32 and rounding once; a plain TMA store would overwrite the gradient it adds to, and a storing
# wgrad must never reduce.
_TMA_STORE = r"\bcp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.tile\b"
_TMA_REDUCE_ADD = r"\bcp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add\.tile\b"
_ADDS = (_TMA_REDUCE_ADD, r"\bld\.global\.v4\.b32\b", r"\bcvt\.rn\.bf16x2\.f32\b")
_EXPECT_WGRAD_ACC = (*_EXPECT_WGRAD, *_ADDS)
# A wgrad cluster multicasts each x box; when dynamic, CTA 0 stores each work item into every CTA's ring
# (st.async, counted as tx bytes on that CTA's mbarrier) and the readers free the slot on CTA 0.
_WGRAD_CLUSTER = _multicast(2)
_HANDOFF = (r"\bst\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.b32\b",
            r"\bmbarrier\.arrive\.expect_tx\.shared::cluster\.b64\b")


# The fused epilogue must round like the standalone activations: canonical NaN selects, no ftz arithmetic
# (libdevice expf's ex2.approx.ftz acts on a range-reduced argument and is exempt), IEEE division (swiglu's
# sigmoid quotient as div.rn's fast path, quotient_rules).
_EXPECT_EPILOGUE = (*_EXPECT_SM90, r"\bsetp\.nan\.f32\b")
_FORBID_EPILOGUE = (*_FORBID_SM90, r"\b(mul|add|sub|div|fma)(\.r[nzmp])?\.ftz\.f32\b",
                    r"\bdiv\.(approx|full)(\.ftz)?\.f32\b")


# Ping-pong warpgroups hand the mainloop to each other by a named barrier's non-blocking arrive.
_TURNS = (r"\bbar\.arrive\b",)


# A dynamic schedule's units come from a device counter (acq_rel fetch-and-add, shuffled to the warp); in a
# cluster CTA 0 hands each to every CTA (_HANDOFF).
_ATOM_ADD = r"\batom\.global\.acq_rel(\.gpu)?\.add\.u32\b"
_GRAB = (_ATOM_ADD, r"\bshfl\.sync\.idx\.b32\b")
# The gathered wgrad's split path counts finished chunks by one such add already: dynamic, it has more.
_SECOND_ADD = rf"(?s){_ATOM_ADD}.*{_ATOM_ADD}"
# A queue-fed cp.async producer lands all its copies in flight at a unit with no stages as well as at its end
# (chunkload.land_pending); a static one waits for all of them once.
_WAIT_ALL = r"\bcp\.async\.wait_group\s+0;"
_SECOND_DRAIN = rf"(?s){_WAIT_ALL}.*{_WAIT_ALL}"


def _drains(queued: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(expected, forbidden) PTX of a cp.async producer's drains, fed by a tile queue or not."""
    return ((_SECOND_DRAIN,), ()) if queued else ((), (_SECOND_DRAIN,))


# The gathered up projection and dgrad: A's rows by 16-byte cp.async in commit groups, landed as the gathered
# wgrad's are, and no 2-D TMA load (B's TMA box is 3-D, and no row is loaded by TMA).
_COPIED_ROWS = (r"\bcp\.async\.cg\.shared\.global\b", r"\bcp\.async\.commit_group\b",
                r"\bcp\.async\.wait_group\b", r"\bfence\.proxy\.async\.shared::cta\b")
_NO_ROW_TMA = r"\bcp\.async\.bulk\.tensor\.2d\.shared::cta\.global\b"


def _rows(dynamic: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(expected, forbidden) PTX of how a gathering fwd/dgrad loads A's rows, fed by a tile queue or not."""
    drains, no_drains = _drains(dynamic)
    return (*_COPIED_ROWS, *drains, *(_GRAB if dynamic else ())), (_NO_ROW_TMA, *no_drains)


def _gather_spec(name: str, n: int, k: int, activation: str, pingpong: bool = False, keep_h: bool = True,
                 deferred: bool = False, dynamic: bool = False) -> KernelSpec:
    """keep_h False: h is never staged or stored, so no stmatrix and none of its 16-byte masked stores
    (act(h) is staged by scalar stores and leaves in 8-byte chunks)."""
    bn = pingpong_bn(activation) if pingpong else pick_bn(n)
    rows, no_rows = _rows(dynamic)
    quotient, no_div = quotient_rules(activation)
    expect: tuple[str, ...] = (*_EXPECT_EPILOGUE, *quotient, *rows, *(_TURNS if pingpong else ()))
    forbid: tuple[str, ...] = (*_FORBID_EPILOGUE, *no_div, *no_rows)
    if not keep_h:
        expect = tuple(rx for rx in expect if rx not in (_STMATRIX, _ST_V4))
        forbid = (*forbid, _STMATRIX, _ST_V4)
    return KernelSpec(op="grouped_gemm_act", name=name,
                      compile=GATHER.compiler(n=n, k=k, bn=bn, act=activation, w_k_major=True,
                                              pingpong=pingpong, keep_h=keep_h, deferred=deferred,
                                              dynamic=dynamic),
                      expect={"sm_90a": expect}, forbid={"sm_90a": forbid})


# The gathered wgrad: the token-major operand by 16-byte cp.async in commit groups; each thread waits for a
# group, fences it from the generic into the async proxy the tensor cores read, then arrives.
_EXPECT_WGRAD_GATHER = (*_EXPECT_WGRAD, r"\bcp\.async\.cg\.shared\.global\b", r"\bcp\.async\.commit_group\b",
                        r"\bcp\.async\.wait_group\b", r"\bfence\.proxy\.async\.shared::cta\b")
# A wgrad whose dw leaves transposed stages M-contiguous subtiles by transposing stmatrix and sends every
# tile by a 3-d TMA (n, k, group), which bounds it by its group: no masked stores, no 2-d store or add.
_STMATRIX_TRANS = r"\bstmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16\b"
_TMA_STORE_3D = r"\bcp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.tile\b"
_TMA_REDUCE_ADD_3D = r"\bcp\.reduce\.async\.bulk\.tensor\.3d\.global\.shared::cta\.add\.tile\b"
_NOT_TRANSPOSED = (r"\bstmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16\b", _TMA_STORE, _TMA_REDUCE_ADD, _ST_V4,
                   r"\bld\.global\.v4\.b32\b")


# A spilling dgrad's consumers copy each landed row chunk out in permuted order: a predicated 16-byte shared
# load beside a 16-byte global store, which no other gathered fwd/dgrad has.
_SPILL = (r"@p ld\.shared\.v4\.b32 \{a, b, c, d\}", r"@p st\.global\.v4\.b32 \[")


def _dgrad_gather_spec(name: str, n: int, k: int, deferred: bool = False, dynamic: bool = False,
                       spill: bool = False) -> KernelSpec:
    rows, no_rows = _rows(dynamic)
    return KernelSpec(op="grouped_gemm_dgrad", name=name,
                      compile=GATHER.compiler(n=n, k=k, bn=pick_bn(n), act="none", w_k_major=False,
                                              deferred=deferred, dynamic=dynamic, spill=spill),
                      expect={"sm_90a": (*_EXPECT_SM90, *rows, *(_SPILL if spill else ()))},
                      forbid={"sm_90a": (*_FORBID_SM90, *no_rows, *(() if spill else _SPILL))})


def _wgrad_gather_spec(name: str, n: int, k: int, side: str, accumulate: bool = False,
                       transposed: bool = False, dynamic: bool = False) -> KernelSpec:
    drains, no_drains = _drains(dynamic)
    expect: tuple[str, ...] = (*_EXPECT_WGRAD_GATHER, *drains, *((_SECOND_ADD,) if dynamic else ()))
    no_out: tuple[str, ...]
    if transposed:
        expect = (*(p for p in expect if p not in _NOT_TRANSPOSED), _STMATRIX_TRANS,
                  _TMA_REDUCE_ADD_3D if accumulate else _TMA_STORE_3D)
        no_out = (*_NOT_TRANSPOSED, _TMA_STORE_3D if accumulate else _TMA_REDUCE_ADD_3D)
    else:
        expect = (*expect, *(_ADDS if accumulate else ()))
        no_out = (_TMA_STORE if accumulate else _TMA_REDUCE_ADD,)
    return KernelSpec(op="grouped_gemm_wgrad", name=name,
                      compile=WGRAD_GATHER.compiler(n=n, k=k, bn=pick_bn(k), side=side, top_k=8,
                                                    accumulate=accumulate, transposed=transposed,
                                                    dynamic=dynamic),
                      expect={"sm_90a": expect},
                      forbid={"sm_90a": (*_FORBID_SM90, *no_out, *no_drains,
                                         *(() if dynamic else (_SECOND_ADD,)))})


def _spec(name: str, n: int, k: int, bn: int, w_k_major: bool | None, activation: str = "none",
          pingpong: bool = False, deferred: bool = False, dynamic: bool = False) -> KernelSpec:
    extra = (*_CLUSTER, *(_TURNS if pingpong else ()), *((*_GRAB, *_HANDOFF) if dynamic else ()))
    expect = _EXPECT_WGRAD if w_k_major is None else (*_EXPECT_SM90, *extra)
    fused = activation != "none"
    if w_k_major is None:
        op, compile = "grouped_gemm_wgrad", WGRAD.compiler(n=n, k=k, bn=bn, ld=k)
    elif not w_k_major:
        op = "grouped_gemm_dgrad"
        compile = DGRAD.compiler(n=n, k=k, bn=bn, pingpong=pingpong, deferred=deferred, dynamic=dynamic)
    else:
        op = "grouped_gemm_act" if fused else "grouped_gemm"
        compile = FWD.compiler(n=n, k=k, bn=bn, act=activation, pingpong=pingpong, deferred=deferred,
                               dynamic=dynamic)
    return KernelSpec(
        op=op,
        name=name,
        compile=compile,
        expect={"sm_90a": (*_EXPECT_EPILOGUE, *quotient_rules(activation)[0], *extra) if fused else expect},
        forbid={"sm_90a": (*_FORBID_EPILOGUE, *quotient_rules(activation)[1]) if fused else _FORBID_SM90},
    )


# Representative classes: the up projection (N = 2I, K = H), the down projection, their dgrad and wgrad, and
# the up projection with each fused activation at both tile widths; the ping-pong fwd, dgrad and fused forms.
KERNELS: tuple[KernelSpec, ...] = (
    _spec("grouped_gemm_fwd_n128", 2048, 4096, 128, True),
    _spec("grouped_gemm_fwd_n256", 4096, 1024, 256, True),
    _spec("grouped_gemm_dgrad_n128", 1024, 4096, 128, False),
    _spec("grouped_gemm_wgrad_n256", 2048, 4096, 256, None),
    _spec("grouped_gemm_fwd_deferred_n256", 2048, 4096, 256, True, deferred=True),
    _spec("grouped_gemm_dgrad_deferred_n256", 1024, 4096, 256, False, deferred=True),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_dynamic_n256",
               compile=WGRAD.compiler(n=2048, k=4096, bn=256, ld=4096, dynamic=True),
               expect={"sm_90a": (*_EXPECT_WGRAD, r"\batom\.global\.acq_rel(\.gpu)?\.add\.u32\b",
                                  r"\bshfl\.sync\.idx\.b32\b")},
               forbid={"sm_90a": _FORBID_SM90}),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_deferred_n256",
               compile=WGRAD.compiler(n=2048, k=4096, bn=256, ld=4096, dynamic=True, deferred=True),
               expect={"sm_90a": _EXPECT_WGRAD}, forbid={"sm_90a": _FORBID_SM90}),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_cols_accumulate_deferred_n256",
               compile=WGRAD.compiler(n=2048, k=1024, bn=256, ld=4096, accumulate=True, deferred=True),
               expect={"sm_90a": _EXPECT_WGRAD_ACC}, forbid={"sm_90a": (*_FORBID_SM90, _TMA_STORE)}),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_cols_n256",
               compile=WGRAD.compiler(n=2048, k=1024, bn=256, ld=4096), expect={"sm_90a": _EXPECT_WGRAD},
               forbid={"sm_90a": (*_FORBID_SM90, _TMA_REDUCE_ADD)}),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_cols_accumulate_n256",
               compile=WGRAD.compiler(n=2048, k=1024, bn=256, ld=4096, accumulate=True),
               expect={"sm_90a": _EXPECT_WGRAD_ACC}, forbid={"sm_90a": (*_FORBID_SM90, _TMA_STORE)}),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_cluster2_dynamic_n256",
               compile=WGRAD.compiler(n=2048, k=4096, bn=256, ld=4096, dynamic=True, cm=2),
               expect={"sm_90a": (*_EXPECT_WGRAD, *_WGRAD_CLUSTER, *_HANDOFF)},
               forbid={"sm_90a": _FORBID_SM90}),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_cluster2_n256",
               compile=WGRAD.compiler(n=2048, k=4096, bn=256, ld=4096, cm=2),
               expect={"sm_90a": (*_EXPECT_WGRAD, *_WGRAD_CLUSTER)},
               forbid={"sm_90a": (*_FORBID_SM90, _HANDOFF[0])}),
    KernelSpec(op="grouped_gemm_wgrad", name="grouped_gemm_wgrad_rows_n256",
               compile=WGRAD.compiler(n=1024, k=1024, bn=256, ld=1024, gs=4096),
               expect={"sm_90a": _EXPECT_WGRAD}, forbid={"sm_90a": _FORBID_SM90}),
    _spec("grouped_gemm_act_swiglu_n128", 2048, 4096, 128, True, "swiglu"),
    _spec("grouped_gemm_act_swiglu_n256", 4096, 1024, 256, True, "swiglu"),
    _spec("grouped_gemm_act_relu2_n128", 1024, 4096, 128, True, "relu2"),
    _spec("grouped_gemm_act_relu2_n256", 4096, 1024, 256, True, "relu2"),
    _spec("grouped_gemm_fwd_pingpong", 4096, 1024, pingpong_bn("none"), True, pingpong=True),
    _spec("grouped_gemm_dgrad_pingpong", 1024, 4096, pingpong_bn("none"), False, pingpong=True),
    _spec("grouped_gemm_act_swiglu_pingpong", 2048, 4096, pingpong_bn("swiglu"), True, "swiglu",
          pingpong=True),
    _gather_spec("grouped_gemm_act_gathered_swiglu_n256", 2048, 4096, "swiglu"),
    _gather_spec("grouped_gemm_act_gathered_swiglu_pingpong", 2048, 4096, "swiglu", pingpong=True),
    _gather_spec("grouped_gemm_act_gathered_relu2_n128", 1152, 2048, "relu2"),
    _gather_spec("grouped_gemm_act_gathered_relu2_n128_k288", 1152, 288, "relu2"),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_x_n256", 2048, 4096, "b"),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_x_n128", 1024, 1152, "b"),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_dy_n128", 4096, 1152, "a"),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_dy_accumulate_n256", 1536, 256, "a", accumulate=True),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_x_on_m_n256", 4096, 2048, "a", transposed=True),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_x_on_m_dynamic_n256", 4096, 2048, "a", transposed=True,
                       dynamic=True),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_dy_accumulate_dynamic_n128", 1536, 1152, "a",
                       accumulate=True, dynamic=True),
    _wgrad_gather_spec("grouped_gemm_wgrad_gathered_x_on_m_accumulate_n128", 1160, 1152, "a", accumulate=True,
                       transposed=True),
    _dgrad_gather_spec("grouped_gemm_dgrad_gathered_n256", 1024, 4096),
    _gather_spec("grouped_gemm_act_gathered_swiglu_n256_act_only_dynamic", 2048, 4096, "swiglu", keep_h=False,
                 dynamic=True),
    _gather_spec("grouped_gemm_act_gathered_swiglu_n256_deferred", 2048, 4096, "swiglu", deferred=True),
    _gather_spec("grouped_gemm_act_gathered_swiglu_n256_act_only_deferred", 2048, 4096, "swiglu",
                 keep_h=False, deferred=True),
    _gather_spec("grouped_gemm_act_gathered_relu2_n128_deferred", 1152, 2048, "relu2", deferred=True),
    _dgrad_gather_spec("grouped_gemm_dgrad_gathered_n256_deferred", 1024, 4096, deferred=True),
    _gather_spec("grouped_gemm_act_gathered_swiglu_n256_dynamic", 2048, 4096, "swiglu", dynamic=True),
    _dgrad_gather_spec("grouped_gemm_dgrad_gathered_n256_dynamic", 1024, 4096, dynamic=True),
    _dgrad_gather_spec("grouped_gemm_dgrad_gathered_n256_spill_dynamic", 1024, 4096, dynamic=True,
                       spill=True),
    _dgrad_gather_spec("grouped_gemm_dgrad_gathered_n128_spill_k_tail", 1152, 1000, dynamic=True, spill=True),
    _spec("grouped_gemm_act_swiglu_deferred_n256", 2048, 4096, 256, True, "swiglu", deferred=True),
    _spec("grouped_gemm_fwd_pingpong_dynamic", 4096, 1024, pingpong_bn("none"), True, pingpong=True,
          dynamic=True),
    _spec("grouped_gemm_dgrad_deferred_dynamic_n256", 4096, 2048, 256, False, deferred=True, dynamic=True),
)
