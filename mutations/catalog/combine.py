"""combine.*: defects in nmoe/reference/combine.py."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/combine.py"
TESTS = "tests/test_combine.py"
SCALE = "    acc = acc * torch.tensor(routed_scale, dtype=acc_dt)\n"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "combine.scale_dropped", FILE, SCALE, "",
        "routed_scale never applied to the routed sum", TESTS, ("combine",),
    ),
    sep_mutation(
        "combine.scale_on_shared_too", FILE,
        SCALE + "    if shared is not None:\n"
        "        if shared.shape != acc.shape:\n"
        "            raise ValueError(f\"combine: shared {tuple(shared.shape)} must be [T,H] = "
        "{tuple(acc.shape)}\")\n"
        "        acc = acc + shared.to(acc_dt)\n",
        "    if shared is not None:\n"
        "        acc = acc + shared.to(acc_dt)\n" + SCALE,
        "routed_scale applied after adding the shared expert, so it scales the shared output too", TESTS,
        ("combine",),
    ),
    sep_mutation(
        "combine.scale_folded_into_weights", FILE,
        "    wa, ya = w.to(acc_dt), y.to(acc_dt)\n",
        "    wa, ya = w.to(acc_dt) * torch.tensor(routed_scale, dtype=acc_dt), y.to(acc_dt)\n"
        "    routed_scale = 1.0\n",
        "routed_scale folded into the router weights (w*s)*y instead of scaling the fp32 sum", TESTS,
        ("combine",),
    ),
    sep_mutation(
        "combine.slot_order_reversed", FILE,
        "    acc = wa[:, 0, None] * ya[:, 0]\n    for k in range(1, y.shape[1]):",
        "    acc = wa[:, -1, None] * ya[:, -1]\n    for k in range(y.shape[1] - 2, -1, -1):",
        "slots summed from k=K-1 down to 0 instead of slot order", TESTS, ("combine",),
    ),
    Mutation(
        "combine.bwd_scale_dropped", FILE,
        "    g = dout.to(acc_dt) * torch.tensor(routed_scale, dtype=acc_dt)",
        "    g = dout.to(acc_dt)",
        "combine backward forgets routed_scale in dy and dw",
        tests=(f"{TESTS}::test_bwd_bf16_dy_bitwise_and_dw_close",
               f"{TESTS}::test_explicit_bwd_matches_autograd_of_float64_formula"), contracts=("combine",),
    ),
)
