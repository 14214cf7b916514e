"""`nmoe parity`: fast op vs spec on a GPU; on a CPU, spec self-checks plus sm_90a/sm_100a compiles.
Execution that did not happen is "not run" with its reason, never a pass; exit 1 when any case or
compile fails, 2 on usage errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from nmoe.outpaths import UnwritableError, require_writable
from parity import report as rep
from parity.registry import ARCHS, select
from parity.runner import Options, detect_arch, run
from parity.tables import list_table, summary_table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nmoe parity", description=__doc__)
    p.add_argument("--ops", default="", help="comma-separated op names or globs (default: all)")
    p.add_argument("--arch", choices=ARCHS, help="restrict compiles (CPU) / assert the GPU arch (GPU)")
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--history", action="store_true", help="print the last runs per op from --db and exit")
    p.add_argument("--last", type=int, default=5, help="runs per op shown by --history")
    p.add_argument("--db", help=f"DuckDB history file (default: ${rep.DB_ENV}, else "
                   "$XDG_DATA_HOME/nmoe/parity-history.duckdb, XDG_DATA_HOME defaulting to ~/.local/share)")
    p.add_argument("--no-db", action="store_true", help="do not append this run to the DuckDB history")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, help="random cases per op (default 3 on CPU, 8 on GPU)")
    p.add_argument(
        "--mode",
        choices=("auto", "selfcheck", "parity"),
        default="auto",
        help="auto: parity on a supported GPU, else reference self-checks",
    )
    p.add_argument(
        "--device", default="cuda", help="device of the fast op in parity mode (cpu: harness tests)"
    )
    p.add_argument("--jobs", type=int, default=1, help="ops run in this many processes (each op in one)")
    p.add_argument("--no-compile", action="store_true", help="skip the sm_90a/sm_100a compile checks")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--list", action="store_true", help="list the registered contracts and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    if args.list:
        print(list_table())
        return 0
    db = Path(args.db) if args.db else rep.default_db()
    if args.history:
        try:
            print(rep.history(db, ops or None, args.last))
        except rep.HistoryLocked as e:
            print(f"nmoe parity: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        select(list(ops) or None)
    except ValueError as e:
        print(f"nmoe parity: {e}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"nmoe parity: --jobs {args.jobs} must be >= 1", file=sys.stderr)
        return 2
    mode = args.mode
    if mode == "auto":
        mode = "parity" if detect_arch()[0] is not None else "selfcheck"
    if mode == "parity" and args.device == "cpu" and args.arch is None:
        print("nmoe parity: --device cpu needs --arch to pick the contract's arch", file=sys.stderr)
        return 2
    try:
        if args.report:
            require_writable("--report", args.report)
        if not args.no_db:
            require_writable("--db", db)
    except UnwritableError as e:
        print(f"nmoe parity: {e}", file=sys.stderr)
        return 2
    cases = args.cases if args.cases is not None else (3 if mode == "selfcheck" else 8)
    opts = Options(
        ops=ops,
        arch=args.arch,
        mode=mode,
        device=args.device,
        seed=args.seed,
        cases=cases,
        compile=not args.no_compile and mode == "selfcheck",
        quiet=args.quiet,
        jobs=args.jobs,
    )
    report = run(opts, "nmoe parity " + " ".join(sys.argv[1:] if argv is None else argv))
    problems = rep.validate(report)
    if problems:
        print("nmoe parity: report does not match the schema: " + "; ".join(problems[:5]), file=sys.stderr)
        return 1
    if args.report:
        rep.write_json(args.report, report)
    print(summary_table(report))
    if not args.no_db:
        try:
            rep.append_db(db, report)
        except rep.HistoryLocked as e:
            kept = f"this run's results are in {args.report}" if args.report else "this run was not recorded"
            print(f"nmoe parity: {e}; {kept}", file=sys.stderr)
            return 1
    s = report["summary"]
    return 1 if s["failed"] or s["compile"]["fail"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
