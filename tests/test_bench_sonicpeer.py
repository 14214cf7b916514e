"""The SonicMoE peer's results meet our MoE layer rows by name and shape."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sonicpeer import find_row, row_key


def test_peer_rows_are_found_by_name_and_shape(tmp_path: Path) -> None:
    shape = {"T": 8, "H": 16, "I": 4, "E": 2, "K": 1}
    row = {"key": row_key("moe_layer_fwd_zipf", shape), "name": "sonicmoe", "ms": 1.5}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"rows": [row]}))
    assert find_row(path, "moe_layer_fwd_zipf", shape) == {"name": "sonicmoe", "ms": 1.5}
    assert find_row(path, "moe_layer_fwd_uniform", shape) is None
    assert find_row(path, "moe_layer_fwd_zipf", {**shape, "K": 2}) is None
