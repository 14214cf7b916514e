"""The SonicMoE peer's results meet our MoE layer rows by name and shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sonicpeer import find_row, main, row_key, vs_peer


def test_peer_rows_are_found_by_name_and_shape(tmp_path: Path) -> None:
    shape = {"T": 8, "H": 16, "I": 4, "E": 2, "K": 1}
    row = {"key": row_key("moe_layer_fwd_zipf", shape), "name": "sonicmoe", "ms": 1.5}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"rows": [row]}))
    assert find_row(path, "moe_layer_fwd_zipf", shape) == {"name": "sonicmoe", "ms": 1.5}
    assert find_row(path, "moe_layer_fwd_uniform", shape) is None
    assert find_row(path, "moe_layer_fwd_zipf", {**shape, "K": 2}) is None


def test_vs_peer_compares_like_with_like() -> None:
    """Sustained against sustained, one call against one call; memory counts for fwd_bwd alone."""
    peer = {"ms": 12.0, "sustained_ms": 11.0, "peak_extra_GiB": 2.0}
    fwd = vs_peer(peer, ms=10.0, single_ms=10.0, mem_gib=3.0, goal=True, pass_="fwd")
    assert fwd["sustained"] == 1.1 and fwd["single_call"] == 1.2 and fwd["goal"]["met"] is True
    both = vs_peer(peer, ms=10.0, single_ms=10.0, mem_gib=3.0, goal=True, pass_="fwd_bwd")
    assert both["memory_ratio"] == 1.5 and both["goal"]["met"] is False
    slow = vs_peer(peer, ms=10.5, single_ms=10.0, mem_gib=1.0, goal=True, pass_="fwd_bwd")
    assert slow["goal"]["met"] is False
    old = vs_peer({"ms": 12.0, "peak_extra_GiB": 2.0}, ms=10.0, single_ms=10.0, mem_gib=1.0, goal=True,
                  pass_="fwd")
    assert old["sustained"] is None and old["goal"]["met"] is None
    assert "goal" not in vs_peer(peer, ms=10.0, single_ms=10.0, mem_gib=1.0, goal=False, pass_="fwd")


def test_per_config_results_merge_into_one_peer_file(tmp_path: Path) -> None:
    """Processes split by --config write one file each; the bench reads one: every row lands, none twice,
    and runs of another GPU or peer version are refused."""
    head = {"peer": "sonicmoe", "version": "0.1", "torch": "2.11", "gpu": "H100"}
    shapes = [{"T": 8, "H": 16, "I": 4, "E": 2, "K": 1}, {"T": 8, "H": 32, "I": 4, "E": 2, "K": 1}]
    parts = []
    for i, shape in enumerate(shapes):
        rows = [{"key": row_key(f"moe_layer_{p}_uniform", shape), "ms": float(i + 1)}
                for p in ("fwd", "fwd_bwd")]
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({**head, "rows": rows}))
    out = tmp_path / "peer.json"
    assert main(["--out", str(out), "--merge", *map(str, parts)]) == 0
    merged = json.loads(out.read_text())
    assert {k: merged[k] for k in head} == head and len(merged["rows"]) == 4
    assert find_row(out, "moe_layer_fwd_bwd_uniform", shapes[1]) == {"ms": 2.0}
    with pytest.raises(SystemExit, match="twice"):
        main(["--out", str(out), "--merge", str(parts[0]), str(parts[0])])
    parts[1].write_text(json.dumps({**head, "gpu": "H200", "rows": []}))
    with pytest.raises(SystemExit, match="one GPU"):
        main(["--out", str(out), "--merge", *map(str, parts)])


def test_with_router_rows_are_named_apart_and_uniform_only() -> None:
    """The peer's own-router rows never stand in for its routing-given ones, and a routing its bias-free
    router cannot make (Zipf's biased picks) is refused, not timed on other picks."""
    from bench.sonicpeer import _step, peer_name

    assert peer_name("uniform", "fwd", True) == "moe_layer_fwd_uniform_with_router"
    assert peer_name("uniform", "fwd", False) == "moe_layer_fwd_uniform"
    with pytest.raises(ValueError, match="uniform"):
        _step((8, 16, 4, 2, 1), "zipf", "fwd", True)
