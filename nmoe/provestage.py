"""The trees `nmoe prove` compares, as files: BASE and the new tree exported from git (or the working tree),
and `--stage DIR` / `--staged DIR`, which carry both trees and the plan to a host without the repository's
git history (a GPU host gets a copy of the working tree only)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from mutations.model import Mutation

FORMAT: Final = "nmoe-prove-stage/1"
TREES: Final = ("base", "new")
EXCLUDED: Final = ("parity/reports/", "mutations/reports/", "bench/results/", "docs/report-index.png")


class StageError(Exception):
    """A tree cannot be exported or a staged directory cannot be read; the message names the fix."""


@dataclass(frozen=True)
class Plan:
    """What one proof compares: BASE and HEAD as shas (`head_ref` "working tree" when uncommitted changes are
    included), the catalog mutant applied to the new tree (`edit`), and the ops the change touches."""

    base: str
    base_ref: str
    head: str
    head_ref: str
    dirty: bool
    compared: str
    changed: tuple[str, ...] = ()
    ops: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    unclaimed: tuple[str, ...] = ()
    edit: str = ""

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ops"] = {k: list(v) for k, v in self.ops.items()}
        return doc

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> Plan:
        return Plan(doc["base"], doc["base_ref"], doc["head"], doc["head_ref"], bool(doc["dirty"]),
                    doc["compared"], tuple(doc["changed"]), {k: tuple(v) for k, v in doc["ops"].items()},
                    tuple(doc["unclaimed"]), doc["edit"])


def _kept(path: str) -> bool:
    return not path.startswith(EXCLUDED) and path not in EXCLUDED


def _git_bytes(repo: Path, *args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=300, check=False)
    if done.returncode != 0:
        raise StageError(f"git {' '.join(args)} failed in {repo}: {done.stderr.decode(errors='replace')}")
    return done.stdout


def export(repo: Path, rev: str | None, dest: Path) -> None:
    """The tracked files of commit `rev`, or (rev None) the working tree's tracked and untracked files as
    they are on disk, into `dest`; committed reports and results are left out (no test needs them)."""
    dest.mkdir(parents=True, exist_ok=True)
    if rev is not None:
        with tarfile.open(fileobj=io.BytesIO(_git_bytes(repo, "archive", "--format=tar", rev))) as tar:
            tar.extractall(dest, members=[m for m in tar.getmembers() if _kept(m.name)], filter="data")
        return
    listed = _git_bytes(repo, "ls-files", "-co", "--exclude-standard", "-z").decode().split("\0")
    for f in filter(None, listed):
        if _kept(f) and (repo / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / f, dest / f)


def _mutant(mutant: str) -> Mutation:
    from mutations.catalog import CATALOG

    found = [m for m in CATALOG if m.id == mutant]
    if not found:
        raise StageError(f"--mutant {mutant!r} is no catalog mutant; `nmoe mutate --list` lists them")
    return found[0]


def mutant_file(mutant: str) -> str:
    return _mutant(mutant).file


def apply_mutant(tree: Path, mutant: str) -> None:
    """Apply catalog mutant `mutant` (this checkout's catalog) to `tree`: a known-bad change to prove with."""
    from mutations.model import AnchorError, apply

    m = _mutant(mutant)
    path = tree / m.file
    try:
        path.write_text(apply(path.read_text(encoding="utf-8"), m), encoding="utf-8")
    except (AnchorError, FileNotFoundError) as e:
        raise StageError(f"mutant {mutant} does not apply to the new tree: {e}") from e


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stage(plan: Plan, trees: Mapping[str, Path], out: Path, command: str) -> Sequence[Path]:
    """DIR/plan.json and DIR/base.tar.gz, DIR/new.tar.gz, each tree packed with paths relative to its root."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in TREES:
        tar_path = out / f"{name}.tar.gz"
        with tarfile.open(tar_path, "w:gz") as tar:
            for p in sorted(trees[name].rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts:
                    tar.add(p, arcname=p.relative_to(trees[name]).as_posix())
        files[name] = {"file": tar_path.name, "sha256": _sha256(tar_path)}
    doc = {"format": FORMAT, "command": command, "plan": plan.to_json(), "trees": files}
    (out / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    return out / "plan.json", *(out / f["file"] for f in files.values())


def unstage(staged: Path, work: Path) -> tuple[Plan, dict[str, Path]]:
    """The plan of `--staged DIR` and its two trees unpacked under `work`, each checked against its sha256."""
    path = staged / "plan.json"
    if not path.is_file():
        raise StageError(f"{path} is missing; make the directory with `nmoe prove [BASE] --stage {staged}` "
                         "in the repository")
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise StageError(f"{path} has format {doc.get('format')!r}, this nmoe reads {FORMAT}; stage it again "
                         "with this version")
    trees = {}
    for name in TREES:
        entry = doc["trees"][name]
        tar_path = staged / entry["file"]
        if not tar_path.is_file() or _sha256(tar_path) != entry["sha256"]:
            raise StageError(f"{tar_path} is missing or differs from the sha256 in {path}; stage again")
        trees[name] = work / name
        with tarfile.open(tar_path) as tar:
            tar.extractall(trees[name], filter="data")
    return Plan.from_json(doc["plan"]), trees
