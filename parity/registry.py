"""The contract registry: one entry per op of DESIGN.md's inventory, named as the op is everywhere else.
Reference and fast functions resolve lazily by name (nmoe.reference|fast.<module>.<fn>), so a missing
fast op makes its cases "not run", never an import error."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fnmatch
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from parity import builders as b
from parity import builders_formats as bf
from parity import builders_layers as bl
from parity import oracles as o
from parity.compare import (
    BITWISE,
    U_FP32,
    U_HOPPER_FP8_BLOCK,
    Contract,
    bound_contract,
    ratio_contract,
    ulp_contract,
)
from parity.inputs import Inputs, Params, Space

Builder = Callable[[Params, Any, "str | None"], Inputs]
ARCHS = ("sm_90a", "sm_100a")
CPU = "cpu"


@dataclass(frozen=True)
class OpEntry:
    """One op's contract: `contract` covers float outputs unless `output_contracts[i]` or `arch_contracts`
    says otherwise (integers are always bitwise). ref64: the spec accepts fp64 inputs, so it can stand in
    for a missing oracle. inplace: args the op updates in place; their values after the call are outputs."""

    name: str
    module: str
    fn: str
    space: Space
    make: Builder
    contract: Contract
    oracle: o.Oracle | None = None
    output_names: tuple[str, ...] = ()
    output_contracts: Mapping[int, Contract] = field(default_factory=dict)
    arch_contracts: Mapping[str, Contract] = field(default_factory=dict)
    invariants: tuple[o.Invariant, ...] = ()
    adversarial: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("bf16",)
    archs: tuple[str, ...] = ARCHS
    ref64: bool = False
    lowprec: Callable[[Inputs], Any] | None = None
    inplace: tuple[int, ...] = ()
    deterministic: bool = True
    reference: Callable[..., Any] | None = None
    fast: Callable[..., Any] | None = None
    note: str = ""

    def contract_for(self, arch: str, index: int = 0) -> Contract:
        if index in self.output_contracts:
            return self.output_contracts[index]
        return self.arch_contracts.get(arch, self.contract)

    def label(self, arch: str = CPU) -> str:
        main = self.arch_contracts.get(arch, self.contract).label()
        extra = [
            f"{self.output_names[i] if i < len(self.output_names) else f'out[{i}]'}: {c.label()}"
            for i, c in sorted(self.output_contracts.items())
        ]
        return "; ".join([main, *extra])

    def full_space(self, big: bool) -> st.SearchStrategy[dict[str, Any]]:
        return st.tuples(self.space(big), st.sampled_from(self.dtypes)).map(
            lambda ab: {**ab[0], "dtype": ab[1]}
        )


# ----------------------------------------------------------------------------------------------------------
# Resolution


def _lookup(package: str, module: str, fn: str) -> tuple[Callable[..., Any] | None, str]:
    name = f"{package}.{module}"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            return None, f"{name} does not exist"
        raise
    f = getattr(mod, fn, None)
    return (f, "") if callable(f) else (None, f"{name} has no {fn}")


def resolve_reference(entry: OpEntry) -> tuple[Callable[..., Any] | None, str]:
    """(fn, "") or (None, reason); import errors other than the module being absent propagate."""
    if entry.reference is not None:
        return entry.reference, ""
    fn, why = _lookup("nmoe.reference", entry.module, entry.fn)
    return fn, why and f"reference missing: {why}"


def resolve_fast(entry: OpEntry) -> tuple[Callable[..., Any] | None, str]:
    if entry.fast is not None:
        return entry.fast, ""
    fn, why = _lookup("nmoe.fast", entry.module, entry.fn)
    return fn, why and f"no fast implementation ({why})"


def fast_declared(entry: OpEntry) -> bool:
    """Whether nmoe/fast/<module>.py defines <fn>, read from source (no import: cutlass stays unloaded)."""
    if entry.fast is not None:
        return True
    spec = importlib.util.find_spec("nmoe.fast")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        package = f"{root}/{entry.module}/__init__.py"
        path = package if os.path.exists(package) else f"{root}/{entry.module}.py"
        try:
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except OSError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == entry.fn:
                return True
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == entry.fn for t in targets):
                    return True
    return False


# ----------------------------------------------------------------------------------------------------------
# Contracts with their derivations

FP32_NOTE = "bf16/fp32 operands, fp32 accumulator: u_acc = 2^-24 (products of bf16 are exact in fp32)"
GEMM = bound_contract(1, 2, note=FP32_NOTE)
FP8_SM90 = bound_contract(
    1,
    2,
    u_acc=U_FP32,
    block=128,
    u_block=U_HOPPER_FP8_BLOCK,
    note="Hopper fp8 wgmma: ~14-bit in-block accumulation (u_block = 2^-14) over 128-wide K blocks, "
    "each block promoted to an fp32 accumulator (u_acc = 2^-24), as in DeepSeek-V3",
)
FP8_SM100 = bound_contract(1, 2, note="tcgen05 block-scaled MMA accumulates in fp32: u_acc = 2^-24")
ULP1 = ulp_contract(1, note="fp32 internal math, one rounding to bf16: fp32 error << 1 bf16 ULP")
RATIO2_BF16 = ratio_contract(
    2,
    floor=2.0**-8,
    note="max-norm; floor = one bf16 ULP of max|ref64|: below it "
    "the bf16 output cannot tell implementations apart",
)
RATIO2_FP32 = ratio_contract(2, floor=2.0**-24, note="max-norm; floor = one fp32 ULP of max|ref64|")
CANCEL = bound_contract(
    1,
    2,
    note="fp32 steps (u = 2^-24) of a difference that cancels; per-step magnitudes "
    "in the oracle (ulp(1) cannot hold where the result cancels)",
)
CE = bound_contract(1, 2, note="fp32 GEMM (u = 2^-24, K = D) propagated through logsumexp; see oracles")

ELEMENTWISE_ADV = ("nan", "inf", "denormal", "max", "zero")
ROUTING_ADV = ("empty_expert", "single_token", "k1", "zipf")
GEMM_ADV = ("zero", "empty_expert", "single_token", "k1", "nan", "inf", "denormal", "max", "zipf")


def _quant(block: int) -> list[OpEntry]:
    return [
        OpEntry(
            f"quantize_mxfp8_{block}",
            "formats",
            "quantize_mxfp8",
            bf.space_quant,
            bf.make_quantize_mxfp8(block),
            BITWISE,
            o.quantize_mxfp8,
            ("codes", "scales"),
            adversarial=("nan", "inf", "denormal", "max", "ties", "zero"),
            dtypes=("fp32", "bf16"),
        ),
        OpEntry(
            f"dequantize_mxfp8_{block}",
            "formats",
            "dequantize_mxfp8",
            bf.space_dequant,
            bf.make_dequantize_mxfp8(block),
            BITWISE,
            o.dequantize_mxfp8,
            adversarial=("nan", "max", "denormal"),
            dtypes=("fp32",),
        ),
    ]


ENTRIES: list[OpEntry] = [
    *_quant(32),
    *_quant(128),
    OpEntry(
        "quantize_mxfp8_w128",
        "formats",
        "quantize_mxfp8_weight",
        bf.space_quant_w,
        bf.make_quantize_mxfp8_w128,
        BITWISE,
        o.quantize_mxfp8_weight,
        ("codes", "scales"),
        adversarial=("nan", "inf", "denormal", "max", "ties", "zero"),
        dtypes=("fp32", "bf16"),
    ),
    OpEntry(
        "dequantize_mxfp8_w128",
        "formats",
        "dequantize_mxfp8_weight",
        bf.space_quant_w,
        bf.make_dequantize_mxfp8_w128,
        BITWISE,
        o.dequantize_mxfp8_weight,
        adversarial=("nan", "max", "denormal"),
        dtypes=("fp32",),
    ),
    OpEntry(
        "quantize_nvfp4",
        "formats",
        "quantize_nvfp4",
        bf.space_quant,
        bf.make_quantize_nvfp4,
        BITWISE,
        o.quantize_nvfp4,
        ("packed", "block_scales", "tensor_scale"),
        adversarial=("nan", "inf", "denormal", "max", "ties", "zero"),
        dtypes=("fp32", "bf16"),
    ),
    OpEntry(
        "dequantize_nvfp4",
        "formats",
        "dequantize_nvfp4",
        bf.space_dequant,
        bf.make_dequantize_nvfp4,
        BITWISE,
        o.dequantize_nvfp4,
        adversarial=("max", "denormal"),
        dtypes=("fp32",),
    ),
    OpEntry(
        "relu2",
        "activation",
        "relu2",
        b.space_rows,
        b.make_relu2,
        BITWISE,
        o.relu2,
        adversarial=(*ELEMENTWISE_ADV, "ties"),
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
    OpEntry(
        "relu2_bwd",
        "activation",
        "relu2_bwd",
        b.space_rows,
        b.make_relu2_bwd,
        BITWISE,
        o.relu2_bwd,
        adversarial=(*ELEMENTWISE_ADV, "ties"),
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
    OpEntry(
        "swiglu",
        "activation",
        "swiglu",
        b.space_swiglu,
        b.make_swiglu,
        ULP1,
        o.swiglu,
        adversarial=ELEMENTWISE_ADV,
        ref64=True,
    ),
    OpEntry(
        "swiglu_bwd",
        "activation",
        "swiglu_bwd",
        b.space_swiglu,
        b.make_swiglu_bwd,
        ULP1,
        o.swiglu_bwd,
        adversarial=ELEMENTWISE_ADV,
        ref64=True,
    ),
    OpEntry(
        "combine",
        "combine",
        "combine",
        b.space_combine,
        b.make_combine,
        BITWISE,
        o.combine,
        adversarial=(*ELEMENTWISE_ADV, "ties", "k1", "single_token"),
        ref64=True,
    ),
    OpEntry(
        "combine_bwd",
        "combine",
        "combine_bwd",
        b.space_combine,
        b.make_combine_bwd,
        BITWISE,
        o.combine_bwd,
        ("dy", "dw", "dshared"),
        output_contracts={1: bound_contract(1, 2, note="dw: fp32 sum over H, order unpinned; " + FP32_NOTE)},
        adversarial=("nan", "inf", "denormal", "zero", "k1", "single_token"),
        ref64=True,
    ),
    OpEntry(
        "router_logits",
        "router",
        "router_logits",
        b.space_router_logits,
        b.make_router_logits,
        GEMM,
        o.router_logits,
        adversarial=("nan", "inf", "zero", "max", "single_token", "k1"),
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
    OpEntry(
        "router_topk",
        "router",
        "router_topk",
        b.space_router_topk,
        b.make_router_topk,
        BITWISE,
        None,
        ("weights", "ids"),
        invariants=(o.router_topk_invariants,),
        adversarial=("ties", "inf", "max", "zipf", "single_token", "k1"),
        dtypes=("fp32",),
        note="no closed-form oracle: invariants (top-k set, order, tie-break, normalised weights); "
        "NaN logits trap the kernel (a dead CUDA context): that case is a subprocess test in "
        "tests/test_fast_router.py",
    ),
    OpEntry(
        "bias_update",
        "router",
        "bias_update",
        b.space_bias_update,
        b.make_bias_update,
        BITWISE,
        o.bias_update,
        adversarial=("ties", "zero", "max", "zipf"),
        dtypes=("fp32",),
    ),
    OpEntry(
        "permute",
        "dispatch",
        "permute",
        b.space_permute,
        b.make_permute,
        BITWISE,
        o.permute,
        ("xp", "counts", "offs", "slot"),
        invariants=(o.permute_invariants,),
        adversarial=(*ROUTING_ADV, "nan", "zero"),
    ),
    OpEntry(
        "unpermute",
        "dispatch",
        "unpermute",
        b.space_permute,
        b.make_unpermute,
        BITWISE,
        o.unpermute,
        adversarial=(*ROUTING_ADV, "nan"),
    ),
    OpEntry(
        "rdep_dispatch",
        "rdep",
        "rdep_dispatch",
        b.space_rdep,
        b.make_rdep_dispatch,
        BITWISE,
        o.rdep_dispatch,
        invariants=(o.rdep_dispatch_invariants,),
        adversarial=(*ROUTING_ADV, "overflow", "nan"),
    ),
    OpEntry(
        "rdep_return",
        "rdep",
        "rdep_return",
        b.space_rdep,
        b.make_rdep_return,
        BITWISE,
        o.rdep_return,
        invariants=(o.rdep_return_invariants,),
        adversarial=(*ROUTING_ADV, "nan"),
    ),
    OpEntry(
        "grouped_gemm",
        "gemm",
        "grouped_gemm",
        b.space_gemm,
        b.make_grouped_gemm,
        GEMM,
        o.grouped_gemm,
        adversarial=GEMM_ADV,
    ),
    OpEntry(
        "grouped_gemm_dgrad",
        "gemm",
        "grouped_gemm_dgrad",
        b.space_gemm,
        b.make_grouped_gemm_dgrad,
        GEMM,
        o.grouped_gemm_dgrad,
        adversarial=GEMM_ADV,
    ),
    OpEntry(
        "grouped_gemm_wgrad",
        "gemm",
        "grouped_gemm_wgrad",
        b.space_gemm,
        b.make_grouped_gemm_wgrad,
        GEMM,
        o.grouped_gemm_wgrad,
        adversarial=("zero", "empty_expert", "single_token", "k1", "nan", "inf", "denormal", "zipf"),
    ),
    OpEntry(
        "grouped_gemm_fp8",
        "gemm",
        "grouped_gemm_fp8",
        b.space_gemm_q,
        b.make_grouped_gemm_fp8,
        GEMM,
        o.grouped_gemm_fp8,
        arch_contracts={"sm_90a": FP8_SM90, "sm_100a": FP8_SM100},
        adversarial=("zero", "empty_expert", "single_token", "nan", "denormal"),
        dtypes=("fp8",),
    ),
    OpEntry(
        "grouped_gemm_nvfp4",
        "gemm",
        "grouped_gemm_nvfp4",
        b.space_gemm_q,
        b.make_grouped_gemm_nvfp4,
        bound_contract(1, 2, note="tcgen05 block-scaled fp4 MMA, fp32 accumulator: u_acc = 2^-24"),
        o.grouped_gemm_nvfp4,
        adversarial=("zero", "empty_expert", "single_token", "nan", "denormal"),
        dtypes=("nvfp4",),
        archs=("sm_100a",),
    ),
    OpEntry(
        "grouped_gemm_act",
        "gemm",
        "grouped_gemm_act",
        b.space_gemm_act,
        b.make_grouped_gemm_act,
        bound_contract(
            1,
            2,
            note="GEMM bound (fp32, u_acc = 2^-24) plus h's bf16 rounding, pushed "
            "through the activation as an interval, then 1 ULP of the output",
        ),
        o.grouped_gemm_act,
        adversarial=("zero", "empty_expert", "single_token", "k1"),
    ),
    OpEntry(
        "rmsnorm",
        "norm",
        "rmsnorm",
        bl.space_norm,
        bl.make_rmsnorm,
        ULP1,
        o.rmsnorm,
        adversarial=("nan", "inf", "denormal", "zero", "single_token"),
        ref64=True,
    ),
    OpEntry(
        "rmsnorm_bwd",
        "norm",
        "rmsnorm_bwd",
        bl.space_norm,
        bl.make_rmsnorm_bwd,
        CANCEL,
        o.rmsnorm_bwd,
        ("dx", "dw"),
        adversarial=("zero", "single_token", "denormal"),
        ref64=True,
    ),
    OpEntry(
        "rope",
        "rope",
        "apply_rope",
        bl.space_rope,
        bl.make_rope,
        CANCEL,
        o.rope,
        adversarial=("nan", "inf", "denormal", "zero", "single_token"),
        ref64=True,
    ),
    OpEntry(
        "mla_attention",
        "attention",
        "mla_attention",
        bl.space_mla,
        bl.make_mla_attention,
        RATIO2_BF16,
        None,
        adversarial=("zero", "single_token", "max"),
        ref64=True,
        lowprec=o.mla_lowprec,
        note="ref64 = the spec on fp64 inputs; baseline = the same math in bf16 torch ops",
    ),
    OpEntry(
        "cross_entropy",
        "loss",
        "cross_entropy",
        bl.space_ce,
        bl.make_cross_entropy,
        CE,
        o.cross_entropy,
        adversarial=("zero", "single_token", "max", "all_ignored"),
        ref64=True,
    ),
    OpEntry(
        "cross_entropy_bwd",
        "loss",
        "cross_entropy_bwd",
        bl.space_ce,
        bl.make_cross_entropy_bwd,
        CE,
        o.cross_entropy_bwd,
        ("dh", "dw"),
        adversarial=("zero", "single_token", "max", "all_ignored"),
        ref64=True,
    ),
    OpEntry(
        "adamw",
        "optim",
        "adamw_step",
        bl.space_adamw,
        bl.make_adamw,
        bound_contract(
            1,
            2,
            note="per-op fp32 roundings (u = 2^-24) of the AdamW update; ulp(n) cannot "
            "hold where m = b1*m + (1-b1)*g cancels",
        ),
        o.adamw,
        ("p", "m", "v"),
        adversarial=("zero", "denormal", "single_token"),
        dtypes=("fp32",),
        ref64=True,
        inplace=(0, 2, 3),
    ),
    OpEntry(
        "muon",
        "optim",
        "muon_step",
        bl.space_muon,
        bl.make_muon,
        RATIO2_FP32,
        o.muon,
        ("p", "buf"),
        output_contracts={1: bound_contract(1, 2, note="buf = mu*buf + g: fp32, u = 2^-24")},
        adversarial=("zero",),
        dtypes=("fp32",),
        ref64=True,
        inplace=(0, 2),
        note="p: ratio against a bf16 Newton-Schulz step; no tight bound survives 5 NS iterations",
    ),
    OpEntry(
        "moe_layer",
        "moe",
        "moe_layer",
        bl.space_moe,
        bl.make_moe_layer,
        RATIO2_BF16,
        o.moe_layer,
        ("out", "weights", "ids", "counts"),
        output_contracts={1: BITWISE},
        adversarial=("zero", "single_token", "k1", "zipf"),
        note="bf16 experts; routing bitwise, output ratio(2) against a bf16 torch composition",
    ),
]

REGISTRY: dict[str, OpEntry] = {e.name: e for e in ENTRIES}


def select(patterns: Sequence[str] | None, registry: Mapping[str, OpEntry] | None = None) -> list[OpEntry]:
    """Entries whose names match any pattern (fnmatch, e.g. "grouped_gemm*"); None/empty selects all."""
    reg = REGISTRY if registry is None else registry
    if not patterns:
        return list(reg.values())
    chosen: list[OpEntry] = []
    for pat in patterns:
        hits = [e for name, e in reg.items() if fnmatch.fnmatchcase(name, pat)]
        if not hits:
            raise ValueError(f"no parity op matches {pat!r}; known ops: {', '.join(reg)}")
        chosen += [h for h in hits if h not in chosen]
    return chosen


@contextlib.contextmanager
def override(
    name: str,
    *,
    reference: Callable[..., Any] | None = None,
    fast: Callable[..., Any] | None = None,
    registry: dict[str, OpEntry] | None = None,
    **fields: Any,
) -> Iterator[OpEntry]:
    """Temporarily swap an entry's reference/fast function (or other fields), e.g. to inject a wrong op."""
    reg = REGISTRY if registry is None else registry
    if name not in reg:
        raise KeyError(f"no parity op {name!r}; known ops: {', '.join(reg)}")
    old = reg[name]
    changes: dict[str, Any] = dict(fields)
    if reference is not None:
        changes["reference"] = reference
    if fast is not None:
        changes["fast"] = fast
    reg[name] = dataclasses.replace(old, **changes)
    try:
        yield reg[name]
    finally:
        reg[name] = old
