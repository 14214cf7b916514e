"""model.*: wiring defects in the reference model composition (nmoe/reference/model.py)."""

from __future__ import annotations

from mutations.model import Mutation

FILE = "nmoe/reference/model.py"
TESTS = "tests/test_model.py"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "model.final_norm_dropped", FILE,
        "        return rmsnorm(h, self.norm.to(COMPUTE), self.cfg.norm_eps)",
        "        return h",
        "final rmsnorm before the output head skipped",
        tests=(f"{TESTS}::test_hidden_wiring_matches_manual_composition",), contracts=("model",),
    ),
    Mutation(
        "model.attn_residual_dropped", FILE,
        "        h = h + a\n",
        "        h = a\n",
        "attention output replaces the residual stream instead of adding to it",
        tests=(f"{TESTS}::test_hidden_wiring_matches_manual_composition",), contracts=("model",),
    ),
    Mutation(
        "model.dense_layers_off_by_one", FILE,
        "DenseFFN(cfg, init) if layer_id < cfg.n_dense_layers else MoE(cfg, init)",
        "DenseFFN(cfg, init) if layer_id <= cfg.n_dense_layers else MoE(cfg, init)",
        "one dense FFN layer too many: the first MoE layer is built dense",
        tests=(f"{TESTS}::test_structure_and_param_dtypes",), contracts=("model",),
    ),
)
