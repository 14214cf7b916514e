"""The real catalog fits the current source: exact anchors, compiling mutants, existing killing tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mutations import runner
from mutations.catalog import CATALOG, TESTS_BY_FILE
from mutations.model import Mutation, apply, check_anchors

ROOT = Path(__file__).resolve().parent.parent

REQUIRED = (
    "relu2.square_dropped", "relu2.silu", "relu2.square_in_bf16", "swiglu.concat_layout",
    "combine.scale_dropped", "combine.scale_on_shared_too", "combine.scale_folded_into_weights",
    "combine.slot_order_reversed", "router.tie_breaks_high", "router.bias_in_weights",
    "router.softmax_unnormalised", "router.scale_in_weights", "bias_update.sign_flipped",
    "dispatch.unstable_order", "dispatch.pad_rows_garbage", "rdep.silent_drop_on_overflow",
    "rdep.owner_off_by_one", "mxfp8.scale_floor_not_ceil", "mxfp8.no_clamp", "nvfp4.block_32_not_16",
    "nvfp4.scale_round_up", "e2m1.ties_away", "e4m3.ties_away", "gemm.accumulate_bf16",
    "gemm.skip_last_k_tile", "gemm.group_boundary_off_by_one", "rmsnorm.eps_outside_sqrt",
    "rope.half_split_layout", "mla.no_causal_mask", "mla.softmax_scale_no_mscale",
    "ce.ignored_tokens_counted", "ce.no_max_subtraction", "adamw.coupled_weight_decay",
    "adamw.no_bias_correction", "muon.ns_coeffs_swapped", "wsd.decay_by_steps", "moe.shared_expert_dropped",
)


def _by_id() -> dict[str, Mutation]:
    return {m.id: m for m in CATALOG}


def test_ids_unique_and_every_named_defect_present() -> None:
    ids = [m.id for m in CATALOG]
    assert len(ids) == len(set(ids))
    assert [i for i in REQUIRED if i not in ids] == []
    assert _by_id()["router.scale_in_weights"].file == "nmoe/reference/moe.py"


def test_at_least_30_cpu_entries_covering_every_reference_module() -> None:
    cpu = [m for m in CATALOG if m.device == "cpu"]
    assert len(cpu) >= 30
    modules = {f"nmoe/reference/{p.name}" for p in (ROOT / "nmoe" / "reference").glob("*.py")
               if p.name != "__init__.py"}
    assert modules - {m.file for m in cpu} == set()


def test_every_anchor_matches_exactly_once_in_the_current_source() -> None:
    assert check_anchors(ROOT, CATALOG) == []


@pytest.mark.parametrize("m", CATALOG, ids=lambda m: m.id)
def test_mutant_compiles_and_changes_the_source(m: Mutation) -> None:
    src = (ROOT / m.file).read_text(encoding="utf-8")
    mutated = apply(src, m)
    assert mutated != src
    compile(mutated, m.file, "exec", dont_inherit=True)


@pytest.mark.parametrize("m", CATALOG, ids=lambda m: m.id)
def test_declared_killing_tests_exist(m: Mutation) -> None:
    assert m.tests, f"{m.id} declares no killing test"
    for node in m.tests:
        path, _, name = node.partition("::")
        text = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", text, re.M), node
    sep = m.sep_test_name()
    if any(node.endswith("::" + sep) for node in m.tests):
        assert m.tests == (f"{m.tests[0].split('::')[0]}::{sep}",)


def test_gpu_entries_target_the_fast_path_and_gpu_tests() -> None:
    gpu = [m for m in CATALOG if m.device == "gpu"]
    assert gpu, "the relu2 fast kernel has GPU mutants"
    for m in gpu:
        assert m.file.startswith("nmoe/fast/")
        text = (ROOT / m.tests[0].split("::")[0]).read_text(encoding="utf-8")
        name = m.tests[0].split("::")[1]
        assert re.search(rf"@(pytest\.mark\.)?gpu\n(@.*\n)*def {name}\(", text), f"{name} must be a gpu test"


def test_check_mode_on_the_real_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert runner.main(["--check"]) == 0
    assert f"{len(CATALOG)} anchors match exactly once" in capsys.readouterr().out


def test_tests_for_mapping_and_name_heuristic() -> None:
    declared = Mutation("x.y", "nmoe/reference/moe.py", "a", "b", "d", tests=("tests/test_moe.py::t",))
    assert runner.tests_for(declared, TESTS_BY_FILE, ROOT) == ("tests/test_moe.py::t",)
    mapped = Mutation("x.y", "nmoe/reference/moe.py", "a", "b", "d")
    assert runner.tests_for(mapped, TESTS_BY_FILE, ROOT) == ("tests/test_moe.py",)
    guessed = Mutation("x.y", "nmoe/reference/norm.py", "a", "b", "d")
    assert runner.tests_for(guessed, {}, ROOT) == ("tests/test_norm.py",)
    fast = Mutation("x.y", "nmoe/fast/activation.py", "a", "b", "d")
    assert runner.tests_for(fast, {}, ROOT) == ("tests/test_fast_activation.py",)
    assert runner.tests_for(Mutation("x.y", "nmoe/none.py", "a", "b", "d"), {}, ROOT) == ()
