"""bench/clocks.py on CPU: nvidia-smi's csv lines parse, and a window keeps only the samples of its spans."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from benchmod import load_bench

clocks = load_bench("clocks")
LINES = [
    "2026/12/04 14:57:28.195, 1965, 149.77, 35, 0x0000000000000004",
    "2026/12/04 14:57:28.215, 1410, 698.30, 54, 0x0000000000000004",
    "2026/12/04 14:57:28.235, 1500, 692.24, 54, 0x0000000000000000",
    "not a sample line",
    "2026/12/04 14:57:28.255, [N/A], 1.0, 1, 0x0",
]


def test_parse_keeps_sample_lines_only() -> None:
    rows = clocks.parse_smi(LINES)
    assert [r[1:] for r in rows] == [(1965.0, 149.77, "0x0000000000000004"),
                                     (1410.0, 698.3, "0x0000000000000004"),
                                     (1500.0, 692.24, "0x0000000000000000")]
    assert rows[0][0] == datetime(2026, 12, 4, 14, 57, 28, 195000).timestamp()


def test_window_takes_the_median_inside_its_spans() -> None:
    rows = clocks.parse_smi(LINES)
    t = [r[0] for r in rows]
    got = clocks.window(rows, [(t[1] - 1e-3, t[2] + 1e-3)])
    assert (got["samples"], got["sm_mhz"], got["power_w"]) == (2, 1455.0, (698.3 + 692.24) / 2)
    assert got["throttle_reasons"] == ["0x0000000000000000", "0x0000000000000004"]
    both = clocks.window(rows, [(t[0], t[0]), (t[2], t[2])])
    assert (both["samples"], both["sm_mhz"]) == (2, (1965 + 1500) / 2)
    assert clocks.window(rows, [(0.0, 1.0)]) == {"samples": 0, "sm_mhz": None, "power_w": None,
                                                 "throttle_reasons": []}


def test_write_keeps_the_rows_and_says_how_they_were_timed(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The document the layer's, the up wgrad's and SonicMoE's clock probes share: provenance, shape, rows."""
    row = {"cold_median_ms": 2.0, "sustained_median_ms": 2.5, "slowdown": 1.25, "clocks": {}}
    out = tmp_path / "c.json"
    clocks.write(out, "python -m bench.clocks --what up_wgrad", (8, 16, 4, 2, 1), 1e9, {"a": row},
                 timing="eager")
    doc = json.loads(out.read_text())
    assert doc["shape"] == {"T": 8, "H": 16, "I": 4, "E": 2, "K": 1} and doc["rows"] == {"a": row}
    assert doc["timing"] == "eager" and doc["provenance"]["command"].endswith("--what up_wgrad")
    assert "a: cold 2.00 ms, sustained 2.50 ms (x1.250)" in capsys.readouterr().out
