"""`nmoe` entry point: one subcommand per job, each owned by the module that does the job."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

COMMANDS: dict[str, tuple[str, str, str]] = {
    "parity": ("parity.cli", "main", "run every parity contract (GPU) or self-checks + compiles (CPU)"),
    "mutate": ("mutations.runner", "main", "run the mutation catalog and write a report"),
    "mutate-html": ("mutations.html", "main", "render a mutation report JSON as one offline HTML page"),
    "bench": ("nmoe.benchcli", "main", "run the GPU benchmarks under bench/"),
    "train": ("nmoe.traincli", "main", "train from a TOML config (fast path; CPU spec model only by name)"),
    "prep": ("nmoe.data.prep", "main", "tokenize text into uint32 shards with a manifest"),
    "runs": ("nmoe.train.metrics", "runs_main", "list experiment runs"),
    "metrics": ("nmoe.runreport", "main", "one run's metrics: a table, a PNG over steps and a report JSON"),
    "plots": ("nmoe.plots", "main", "plot bench results and a run's metrics as PNGs with an index page"),
    "prove": ("nmoe.prove", "main", "prove a change: parity, mutants and A/B bench of the ops it touches"),
    "report": ("nmoe.reportindex", "main", "index the committed reports per op: newest, sha, dirty, stale"),
}


def _usage() -> str:
    lines = ["usage: nmoe COMMAND [ARGS...]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"nmoe: unknown command {name!r}\n{_usage()}", file=sys.stderr)
        return 2
    module, attr, _ = COMMANDS[name]
    fn: Callable[[list[str]], int] = getattr(importlib.import_module(module), attr)
    return fn(rest)


if __name__ == "__main__":
    raise SystemExit(main())
