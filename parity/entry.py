"""One op's parity declaration (OpEntry) and the contracts several op families share; each family
module under parity/ops/ holds its own entries, and parity/registry.py collects them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from parity.compare import Contract, bound_contract, ratio_contract
from parity.inputs import Inputs, Params, Space
from parity.oracles import Invariant, Oracle

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
    oracle: Oracle | None = None
    output_names: tuple[str, ...] = ()
    output_contracts: Mapping[int, Contract] = field(default_factory=dict)
    arch_contracts: Mapping[str, Contract] = field(default_factory=dict)
    invariants: tuple[Invariant, ...] = ()
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


FP32_NOTE = "bf16/fp32 operands, fp32 accumulator: u_acc = 2^-24 (products of bf16 are exact in fp32)"
GEMM = bound_contract(1, 2, note=FP32_NOTE)
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

ELEMENTWISE_ADV = ("nan", "inf", "denormal", "max", "zero")
ROUTING_ADV = ("empty_expert", "single_token", "k1", "zipf")
GEMM_ADV = ("zero", "empty_expert", "single_token", "k1", "nan", "inf", "denormal", "max", "zipf")
