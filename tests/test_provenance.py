"""Which commit a report names: the NMOE_GIT_SHA override, its strict dirty flag, and git otherwise."""

from __future__ import annotations

import re
import shutil

import pytest

from nmoe.provenance import provenance


def test_env_commit_wins_over_git(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMOE_GIT_SHA", "f" * 40)
    monkeypatch.setenv("NMOE_GIT_DIRTY", "0")
    p = provenance("x")
    assert (p["git_sha"], p["git_dirty"], p["command"]) == ("f" * 40, False, "x")
    monkeypatch.setenv("NMOE_GIT_DIRTY", "1")
    assert provenance("x")["git_dirty"] is True


@pytest.mark.parametrize("flag", ["", "false", "yes", "00"])
def test_env_dirty_flag_is_strict(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    monkeypatch.setenv("NMOE_GIT_SHA", "f" * 40)
    monkeypatch.setenv("NMOE_GIT_DIRTY", flag)
    with pytest.raises(ValueError, match="NMOE_GIT_DIRTY"):
        provenance("x")


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed: the git branch is not run")
def test_git_names_this_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NMOE_GIT_SHA", raising=False)
    p = provenance("x")
    if p["git_sha"] is None:
        pytest.skip("tree has no .git: the git branch is not run")
    assert re.fullmatch(r"[0-9a-f]{40}", p["git_sha"])
    assert isinstance(p["git_dirty"], bool)
