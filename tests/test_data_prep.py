"""`nmoe prep`: deterministic shards of the embedded corpus, index/EOS layout, re-run skipping, --verify."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import types
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nmoe.data import prep
from nmoe.data import tokenizer as tok

CORPUS_TOKENS = 1_361_327
CORPUS_DOCS = 42


def corpus_docs() -> list[dict[str, Any]]:
    with gzip.open(prep.DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def shard_hashes(out: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((out / "manifest.json").read_text())["shards"]]


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "a"
    assert prep.main(["--out", str(out), "--workers", "1", "--shard-bytes", "1000000", "--no-progress"]) == 0
    return out


def test_data_imports_no_fast_path_spec_parity_or_trainer() -> None:
    """nmoe/data runs on any machine, apart from the model (docs/design.md, dependency rules)."""
    code = ("import sys; import nmoe.data.prep, nmoe.data.tokenizer, nmoe.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('parity', 'cutlass') "
            "or m.startswith(('nmoe.fast', 'nmoe.reference', 'nmoe.train'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_embedded_corpus_is_real_and_licensed() -> None:
    docs = corpus_docs()
    assert len(docs) == CORPUS_DOCS
    assert sum(len(d["text"]) for d in docs) > 5_000_000
    assert {"Hamlet", "Macbeth", "Sonnets", "The Tempest"} <= {d["title"] for d in docs}
    readme = " ".join((prep.CORPUS_DIR / "README.md").read_text().split())
    assert "public domain" in readme and "Creative Commons Attribution 2.5" in readme


def test_prep_is_deterministic_across_runs_and_workers(small_shards: Path, tmp_path: Path) -> None:
    other = tmp_path / "b"
    args = ["--out", str(other), "--workers", "2", "--shard-bytes", "1000000", "--no-progress"]
    assert prep.main(args) == 0
    assert shard_hashes(other) == shard_hashes(small_shards)
    assert (other / "manifest.json").read_bytes() == (small_shards / "manifest.json").read_bytes()
    manifest = json.loads((small_shards / "manifest.json").read_text())
    assert manifest["total_tokens"] == CORPUS_TOKENS and manifest["total_docs"] == CORPUS_DOCS
    assert len(manifest["shards"]) == 5
    assert manifest["vocab_size"] == 201088 and manifest["eos_id"] == tok.EOS_ID


def test_default_invocation_writes_data_default(small_shards: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert prep.main(["--workers", "1", "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "data" / "default" / "manifest.json").read_text())
    assert manifest["total_tokens"] == CORPUS_TOKENS and len(manifest["shards"]) == 1


def test_shards_hold_documents_with_eos_and_index(small_shards: Path) -> None:
    docs = corpus_docs()
    enc = tok.get_encoding()
    manifest = json.loads((small_shards / "manifest.json").read_text())
    seen = 0
    for meta in manifest["shards"]:
        ids = np.fromfile(small_shards / meta["file"], dtype="<u4")
        offsets = np.fromfile(small_shards / meta["index"], dtype="<u8")
        assert offsets[0] == 0 and offsets[-1] == ids.size == meta["tokens"]
        assert meta["first_doc"] == seen
        for j in range(meta["docs"]):
            doc = ids[offsets[j]:offsets[j + 1]]
            assert doc[-1] == tok.EOS_ID and tok.EOS_ID not in doc[:-1]
            if j == 0:
                text = unicodedata.normalize("NFC", docs[seen]["text"])
                assert enc.decode(doc[:-1].tolist()) == text
            seen += 1
        assert meta["text_bytes"] >= 1_000_000 or meta is manifest["shards"][-1]
    assert seen == CORPUS_DOCS


def test_rerun_skips_finished_shards_and_rebuilds_deleted_one(small_shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "c"
    args = ["--out", str(out), "--workers", "1", "--shard-bytes", "1000000", "--no-progress"]
    assert prep.main(args) == 0
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.bin")}
    for f in ("shard_00002.bin", "shard_00002.idx"):
        (out / f).unlink()
    assert prep.main(args) == 0
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.bin")}
    assert {k for k in after if after[k] != stamp[k]} == {"shard_00002.bin"}
    assert shard_hashes(out) == shard_hashes(small_shards)


def test_verify_passes_then_flags_corrupted_shard(small_shards: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    out.mkdir()
    for f in small_shards.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    assert prep.main(["--verify", str(out)]) == 0
    assert "5 shards verified" in capsys.readouterr().out
    shard = out / "shard_00003.bin"
    data = bytearray(shard.read_bytes())
    data[4000] ^= 0x01
    shard.write_bytes(bytes(data))
    assert prep.main(["--verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert "shard_00003.bin: sha256" in err and "corrupt shard" in err
    assert "re-run the same `nmoe prep`" in err
    shard.write_bytes(bytes(data[:-8]))
    assert prep.main(["--verify", str(out)]) == 1
    assert "bytes, manifest says" in capsys.readouterr().err


def test_verify_without_manifest_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prep.main(["--verify", str(tmp_path)]) == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_local_text_and_jsonl_inputs_with_nfc(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("Cafe\u0301 au lait.\n", encoding="utf-8")
    (src / "b.jsonl").write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    out = tmp_path / "out"
    assert prep.main([str(src), "--out", str(out), "--text-field", "body", "--workers", "1",
                      "--no-progress"]) == 0
    ids = np.fromfile(out / "shard_00000.bin", dtype="<u4").tolist()
    enc = tok.get_encoding()
    want = [*enc.encode_ordinary("Caf\u00e9 au lait.\n"), tok.EOS_ID, *enc.encode_ordinary("one"), tok.EOS_ID,
            *enc.encode_ordinary("two"), tok.EOS_ID]
    assert ids == want
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["plan"]["sources"]] == ["a.txt", "b.jsonl"]


def test_changed_inputs_refuse_to_mix_into_old_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "a.txt"
    f.write_text("first version")
    out = tmp_path / "out"
    assert prep.main([str(f), "--out", str(out), "--workers", "1", "--no-progress"]) == 0
    f.write_text("second version")
    assert prep.main([str(f), "--out", str(out), "--workers", "1", "--no-progress"]) == 1
    assert "differs in: sources" in capsys.readouterr().err
    assert prep.main([str(f), "--out", str(out), "--workers", "1", "--no-progress", "--overwrite"]) == 0
    ids = np.fromfile(out / "shard_00000.bin", dtype="<u4").tolist()
    assert tok.get_encoding().decode(ids[:-1]) == "second version"


def test_bad_inputs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    assert prep.main([str(bad), "--out", str(tmp_path / "o"), "--workers", "1", "--no-progress"]) == 1
    assert "x.jsonl:2: no string field 'text'" in capsys.readouterr().err
    assert prep.main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o2")]) == 1
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "y.csv").write_text("a,b")
    assert prep.main([str(tmp_path / "y.csv"), "--out", str(tmp_path / "o3")]) == 1
    assert "unsupported file type" in capsys.readouterr().err


def test_hf_path_streams_through_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def load_dataset(name: str, config: str | None, *, split: str, revision: str | None,
                     streaming: bool) -> list[dict[str, str]]:
        calls.append((name, config, split, revision, streaming))
        return [{"text": "alpha"}, {"text": "beta"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    out = tmp_path / "hf"
    assert prep.main(["--hf", "org/corpus", "--hf-config", "en", "--out", str(out), "--workers", "1",
                      "--no-progress"]) == 0
    assert calls == [("org/corpus", "en", "train", None, True)]
    ids = np.fromfile(out / "shard_00000.bin", dtype="<u4").tolist()
    enc = tok.get_encoding()
    assert ids == [*enc.encode_ordinary("alpha"), tok.EOS_ID, *enc.encode_ordinary("beta"), tok.EOS_ID]


def test_parquet_without_pyarrow_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    f = tmp_path / "t.parquet"
    f.write_bytes(b"PAR1")
    assert prep.main([str(f), "--out", str(tmp_path / "o"), "--workers", "1", "--no-progress"]) == 1
    assert "pip install pyarrow" in capsys.readouterr().err
