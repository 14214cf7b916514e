"""model.*: wiring defects in the one model composition (nmoe/modeldef.py, shared by the spec and fast models)
and in the spec model's own policy (nmoe/reference/model.py)."""

from __future__ import annotations

from mutations.model import Mutation

FILE = "nmoe/modeldef.py"
SPEC = "nmoe/reference/model.py"
TESTS = "tests/test_model.py"
WIRING = f"{TESTS}::test_hidden_wiring_matches_manual_composition"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "model.routing_graph_kept", FILE,
        "        self.last_routing = replace(routing, weights=routing.weights.detach())",
        "        self.last_routing = routing",
        "the MoE layer keeps its routing weights with their autograd graph until the next forward: the "
        "router's AccumulateGrad node, made on the eager step's stream, reaches a CUDA graph capture",
        tests=(f"{TESTS}::test_sep_model_routing_graph_kept",), contracts=("model",),
    ),
    Mutation(
        "model.final_norm_dropped", FILE,
        "        return add_norm(self.ops, h, f, self.norm.to(COMPUTE), self.cfg.norm_eps)[1]",
        "        return h if f is None else h + f",
        "final rmsnorm before the output head skipped",
        tests=(WIRING,), contracts=("model",),
    ),
    Mutation(
        "model.attn_residual_dropped", FILE,
        "        h, x = self.ops.add_rmsnorm(h, a, ",
        "        h, x = self.ops.add_rmsnorm(h * 0, a, ",
        "attention output replaces the residual stream instead of adding to it",
        tests=(WIRING,), contracts=("model",),
    ),
    Mutation(
        "model.dense_layers_off_by_one", FILE,
        "(DenseFFN(cfg, init, ops) if layer_id < cfg.n_dense_layers",
        "(DenseFFN(cfg, init, ops) if layer_id <= cfg.n_dense_layers",
        "one dense FFN layer too many: the first MoE layer is built dense",
        tests=(f"{TESTS}::test_structure_and_param_dtypes",), contracts=("model",),
    ),
    Mutation(
        "model.ffn_normed_with_attn_norm", FILE,
        "self.ops.add_rmsnorm(h, a, self.ffn_norm.to(COMPUTE), self.eps)",
        "self.ops.add_rmsnorm(h, a, self.attn_norm.to(COMPUTE), self.eps)",
        "FFN branch normed with the attention norm's weight (equal at init; the test draws them apart)",
        tests=(WIRING,), contracts=("model",),
    ),
    Mutation(
        "model.router_bias_not_written", FILE,
        "            moe.router_bias.copy_(self.ops.bias_update(moe.router_bias, c, rate, clamp))",
        "            self.ops.bias_update(moe.router_bias, c, rate, clamp)",
        "the aux-loss-free update is computed but never written back to the router bias",
        tests=(f"{TESTS}::test_router_bias_update",), contracts=("model",),
    ),
    Mutation(
        "model.token_ids_unchecked", SPEC,
        "    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):",
        "    if False:",
        "the spec model takes token ids outside the vocabulary instead of refusing them",
        tests=(f"{TESTS}::test_model_input_errors",), contracts=("model",),
    ),
)
