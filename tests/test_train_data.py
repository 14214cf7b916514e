"""Loader: bijective window order, mixture shares, smooth round-robin, rank slices, stages, exact resume."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nmoe.data import prep
from nmoe.train.data import (
    DataError,
    Loader,
    Mixture,
    SourceSpec,
    StageSpec,
    feistel_index,
    load_mixture,
    single_source,
)

REPO = Path(__file__).resolve().parent.parent


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_dataset(out: Path, docs: Sequence[Sequence[int]]) -> Path:
    """A hand-made prepped directory (manifest + one shard) holding the given tokens, with true hashes.
    Its document index is empty: the loader reads windows, never documents, and these end in no EOS."""
    out.mkdir(parents=True)
    flat = np.array([t for d in docs for t in d], dtype="<u4")
    (out / "shard_00000.bin").write_bytes(flat.tobytes())
    (out / "shard_00000.idx").write_bytes(np.zeros(1, dtype="<u8").tobytes())
    meta = {"shard": 0, "file": "shard_00000.bin", "index": "shard_00000.idx", "tokens": int(flat.size),
            "docs": 0, "sha256": sha256(out / "shard_00000.bin"),
            "index_sha256": sha256(out / "shard_00000.idx"), "first_doc": 0, "text_bytes": 0}
    manifest = {"format": prep.FORMAT, "vocab_size": 201088, "eos_id": 199999, "shards": [meta],
                "total_tokens": int(flat.size)}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture()
def two_sources(tmp_path: Path) -> tuple[Path, Path]:
    a = write_dataset(tmp_path / "a", [list(range(0, 400))])
    b = write_dataset(tmp_path / "b", [list(range(100_000, 100_200))])
    return a, b


def loader(mix: Mixture, **kw: int) -> Loader:
    args = {"seq_len": 8, "batch_size": 2, "seed": 0, "prefetch": 0, **kw}
    return Loader(mix, **args)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 700), key=st.integers(0, 2**64 - 1))
def test_feistel_is_a_permutation(n: int, key: int) -> None:
    assert sorted(feistel_index(i, n, key) for i in range(n)) == list(range(n))


def test_feistel_depends_on_key() -> None:
    a = [feistel_index(i, 1000, 1) for i in range(1000)]
    b = [feistel_index(i, 1000, 2) for i in range(1000)]
    assert a != b and a != list(range(1000))


def test_windows_cover_the_source_once_per_epoch(tmp_path: Path) -> None:
    src = write_dataset(tmp_path / "s", [list(range(1000, 1000 + 81))])  # (81-1)//8 = 10 windows
    ld = loader(single_source(str(src)), batch_size=1)
    starts = [int(next(ld).inputs[0, 0]) - 1000 for _ in range(20)]
    assert sorted(starts[:10]) == list(range(0, 80, 8)) == sorted(starts[10:])
    assert starts[:10] != starts[10:]  # a fresh order each epoch
    b = next(ld)
    assert b.targets[0].tolist() == (b.inputs[0] + 1).tolist()


def test_mixture_shares_follow_weight_and_temperature(two_sources: tuple[Path, Path]) -> None:
    a, b = two_sources
    stages = (StageSpec("s0", tokens=800), StageSpec("s1", weights={"a": 0.0, "b": 1.0}))
    mix = Mixture((SourceSpec("a", str(a), 1.0), SourceSpec("b", str(b), 3.0)), stages, temperature=2.0)
    ld = loader(mix)
    q = np.array([1.0 * 400, 3.0 * 200])
    p = (q / q.sum()) ** 0.5
    assert ld.shares[0] == pytest.approx((p / p.sum()).tolist(), rel=1e-12)
    assert ld.shares[1] == [0.0, 1.0]


def test_smooth_round_robin_counts_stay_within_one(two_sources: tuple[Path, Path]) -> None:
    a, b = two_sources
    mix = Mixture((SourceSpec("a", str(a), 1.0), SourceSpec("b", str(b), 1.0)), (StageSpec("main"),))
    ld = loader(mix)  # shares 2/3, 1/3 by token counts
    picks: list[int] = []
    for _ in range(30):
        picks += next(ld).sources
    for n in range(1, len(picks) + 1):
        for i, share in enumerate((2 / 3, 1 / 3)):
            assert abs(picks[:n].count(i) - n * share) < 1.0 + 1e-9


def test_stage_switch_at_token_budget(two_sources: tuple[Path, Path]) -> None:
    a, b = two_sources
    mix = Mixture((SourceSpec("a", str(a)), SourceSpec("b", str(b))),
                  (StageSpec("first", tokens=80, weights={"b": 0.0}), StageSpec("rest", weights={"a": 0.0})))
    ld = loader(mix, batch_size=4)
    picks = [s for _ in range(5) for s in next(ld).sources]
    assert picks == [0] * 10 + [1] * 10  # 80 tokens / seq_len 8 = 10 sequences in stage one


def test_ranks_read_disjoint_slices_of_one_global_stream(two_sources: tuple[Path, Path]) -> None:
    a, b = two_sources
    mix = Mixture((SourceSpec("a", str(a)), SourceSpec("b", str(b))), (StageSpec("main"),))
    whole = loader(mix, batch_size=6)
    ranks = [loader(mix, batch_size=2, rank=r, world=3) for r in range(3)]
    for _ in range(4):
        g = next(whole).inputs
        parts = [next(r).inputs for r in ranks]
        assert np.array_equal(np.concatenate(parts), g.numpy())
    assert ranks[1].tokens_per_step == 8 * 2 * 3


@pytest.mark.parametrize("prefetch", [0, 3])
def test_exact_resume_regardless_of_prefetch(two_sources: tuple[Path, Path], prefetch: int) -> None:
    a, b = two_sources
    mix = Mixture((SourceSpec("a", str(a)), SourceSpec("b", str(b), 2.5)), (StageSpec("main"),))
    ref = loader(mix, prefetch=0)
    seq = [next(ref).inputs.clone() for _ in range(12)]
    ld = loader(mix, prefetch=prefetch)
    for i in range(5):
        assert np.array_equal(next(ld).inputs, seq[i])
    state = json.loads(json.dumps(ld.state_dict()))  # survives a JSON checkpoint
    assert state["global_seq"] == 10
    for _ in range(5, 8):
        next(ld)  # read past the saved state, with batches prefetched even further
    ld.close()
    again = loader(mix, prefetch=prefetch)
    again.load_state_dict(state)
    for i in range(5, 12):
        assert np.array_equal(next(again).inputs, seq[i])
    again.close()


def test_state_from_other_layout_is_refused(two_sources: tuple[Path, Path]) -> None:
    a, _ = two_sources
    state = loader(single_source(str(a))).state_dict()
    with pytest.raises(DataError, match="differs in: seq_len"):
        loader(single_source(str(a)), seq_len=4).load_state_dict(state)


def test_source_too_small_and_vocab_mismatch(tmp_path: Path) -> None:
    small = write_dataset(tmp_path / "small", [[1, 2, 3]])
    with pytest.raises(DataError, match="cannot fill one sequence"):
        loader(single_source(str(small)))
    with pytest.raises(DataError, match=r"model\.vocab_size=1000"):
        loader(single_source(str(small)), seq_len=2, vocab_size=1000)
    with pytest.raises(DataError, match=r"no manifest\.json"):
        loader(single_source(str(tmp_path / "nothing")))


def test_committed_mixtures_parse() -> None:
    default = load_mixture(REPO / "configs" / "mixtures" / "default.toml")
    assert [s.path for s in default.sources] == ["data/default"]
    staged = load_mixture(REPO / "configs" / "mixtures" / "two_stage.toml")
    assert [st.name for st in staged.stages] == ["pretrain", "anneal"]
    assert staged.stages[0].temperature == 1.4 and staged.stages[1].weights == {"web": 1.0, "books": 8.0}


@pytest.mark.parametrize(("body", "error"), [
    ('[[sources]]\nname = "a"\n', "needs string name and path"),
    ('[[sources]]\nname = "a"\npath = "x"\nweight = -1\n', "must be a positive number"),
    ('[[sources]]\nname = "a"\npath = "x"\n[[stages]]\nweights = { b = 1.0 }\n', "unknown sources"),
    ('[[sources]]\nname = "a"\npath = "x"\n[[stages]]\nname = "s"\n[[stages]]\n', "no token budget"),
    ('temprature = 2\n[[sources]]\nname = "a"\npath = "x"\n', "unknown keys"),
])
def test_bad_mixtures_are_named(tmp_path: Path, body: str, error: str) -> None:
    f = tmp_path / "m.toml"
    f.write_text(body)
    with pytest.raises(DataError, match=error):
        load_mixture(f)


def test_share_formula_matches_hand_values(two_sources: tuple[Path, Path]) -> None:
    a, b = two_sources
    sources = (SourceSpec("a", str(a)), SourceSpec("b", str(b)))
    mix = Mixture(sources, (StageSpec("main"),), temperature=math.inf)
    assert loader(mix).shares[0] == pytest.approx([0.5, 0.5])
