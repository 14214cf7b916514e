"""model.fast_*: wiring defects in the fast model composition (nmoe/fast/model.py)."""

from __future__ import annotations

from mutations.model import Mutation

FILE = "nmoe/fast/model.py"
TESTS = "tests/test_fast_model.py"
PARITY = f"{TESTS}::test_fast_model_matches_the_spec_loss_and_gradients"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "model.fast_dense_layers_off_by_one", FILE,
        "DenseFFN(cfg, init) if layer_id < cfg.n_dense_layers else MoE(cfg, init)",
        "DenseFFN(cfg, init) if layer_id <= cfg.n_dense_layers else MoE(cfg, init)",
        "one dense FFN layer too many: the first MoE layer is built dense (names, shapes leave the spec's)",
        tests=(f"{TESTS}::test_meta_model_has_the_spec_names_shapes_and_dtypes",), contracts=("model",),
    ),
    Mutation(
        "model.fast_attn_residual_dropped", FILE,
        "        h = h + a\n",
        "        h = a\n",
        "attention output replaces the residual stream instead of adding to it",
        tests=(PARITY,), device="gpu", contracts=("model",),
    ),
    Mutation(
        "model.fast_ffn_normed_with_attn_norm", FILE,
        "self.ffn(rmsnorm(h, self.ffn_norm.to(COMPUTE), self.eps)",
        "self.ffn(rmsnorm(h, self.attn_norm.to(COMPUTE), self.eps)",
        "the FFN branch is normed with the attention norm's weight (equal at init, so only gradients tell)",
        tests=(PARITY,), device="gpu", contracts=("model",),
    ),
    Mutation(
        "model.fast_router_bias_not_written", FILE,
        "            moe.router_bias.copy_(bias_update(moe.router_bias, c, rate, clamp))",
        "            bias_update(moe.router_bias, c, rate, clamp)",
        "the aux-loss-free update is computed but never written back to the router bias",
        tests=(f"{TESTS}::test_router_bias_update_moves_on_the_gpu",), device="gpu", contracts=("model",),
    ),
)
