"""`nmoe bench`: run the pytest-benchmark suite under bench/ and write the results JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from nmoe.checkout import CheckoutError, require_test_extra, source_dir
from nmoe.outpaths import UnwritableError, require_writable


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nmoe bench", description=__doc__)
    p.add_argument("--out", default="bench/results/latest.json", help="results JSON (docs/reports.md)")
    p.add_argument("-k", dest="select", default=None, help="pytest -k expression selecting benchmarks")
    args = p.parse_args(argv)
    out = Path(args.out).absolute()
    try:
        bench = source_dir("nmoe bench", "bench")
        require_test_extra("nmoe bench", ("pytest", "pytest_benchmark"))
        require_writable("--out", out)
    except (CheckoutError, UnwritableError) as e:
        print(f"nmoe bench: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench", "--benchmark-disable-gc"]
    if args.select:
        cmd += ["-k", args.select]
    env = dict(os.environ, NMOE_BENCH_OUT=str(out), NMOE_BENCH_COMMAND=" ".join(["nmoe bench", *argv]))
    before = out.stat().st_mtime_ns if out.exists() else None
    rc = subprocess.run(cmd, cwd=bench.parent, env=env, check=False).returncode
    if not out.exists() or out.stat().st_mtime_ns == before:
        print(f"nmoe bench: pytest exited {rc} and wrote no results to {out}", file=sys.stderr)
        return rc or 1
    rows = json.loads(out.read_text())["results"]
    counts = Counter(str(r.get("status", "measured")) for r in rows)
    why = sorted({str(r["reason"]) for r in rows if r.get("status") == "not run"})
    line = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"nmoe bench: wrote {out}: {line}" + (f" ({'; '.join(why)})" if why else ""), file=sys.stderr)
    return rc
