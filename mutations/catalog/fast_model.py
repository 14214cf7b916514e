"""model.fast_*: defects in the fast model's own policy (nmoe/fast/model.py: parameter dtype, device checks);
its composition is nmoe/modeldef.py, whose wiring mutants are model.* (catalog/model.py)."""

from __future__ import annotations

from mutations.model import Mutation

FILE = "nmoe/fast/model.py"
TESTS = "tests/test_fast_model.py"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "model.fast_params_built_in_bf16", FILE,
        "super().__init__(cfg, OPS, seed, ce_chunk, ignore_index, dev, PARAM_DTYPES[param_dtype], shard)",
        "super().__init__(cfg, OPS, seed, ce_chunk, ignore_index, dev, torch.bfloat16, shard)",
        "train.param_dtype ignored: fp32 masters are built in bf16 (dtypes leave the spec model's)",
        tests=(f"{TESTS}::test_meta_model_has_the_spec_names_shapes_and_dtypes",), contracts=("model",),
    ),
    Mutation(
        "model.fast_tokens_device_unchecked", FILE,
        "    if tokens.device != embed.device:",
        "    if False:",
        "a batch off the model's GPU is taken instead of refused with the remedy",
        tests=(f"{TESTS}::test_tokens_off_the_models_device_raise_naming_the_gpu",), contracts=("model",),
    ),
)
