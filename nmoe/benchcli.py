"""`nmoe bench`: run the pytest-benchmark suite under bench/ and write the results JSON."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
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
    return subprocess.run(cmd, cwd=bench.parent, env=env, check=False).returncode
