"""``<prefix>.tokenizer.json``: which tokenizer made an indexed dataset, written beside its ``.idx``.

The ``.bin``/``.idx`` pair stays byte-identical to Megatron-LM's format; the identity (SHA-256 of the
model file, vocabulary size, eod id, tokenizer type) lives in this separate file so that training can
refuse data tokenized with another tokenizer.  Datasets made elsewhere (Megatron-LM) have none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megapost.data.errors import DataError
from megapost.data.tokenizer import SentencePieceTokenizer
from megapost.utils.atomic import atomic_write_text
from megapost.utils.checksum import file_sha256

SIDECAR_SUFFIX = ".tokenizer.json"
SIDECAR_VERSION = 1
_IDENTITY_KEYS = ("type", "model_sha256", "vocab_size", "eod")


def sidecar_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}{SIDECAR_SUFFIX}")


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What must agree between preprocessing and training (plus the model file's name, for people)."""
    path = tokenizer.identity_file
    return {"type": tokenizer.kind, "model_sha256": file_sha256(path) if path else None,
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
            "model_file": path.name if path else None}


def describe(identity: dict[str, Any]) -> str:
    """``sentencepiece tokenizer.model (vocab 32000, eod 2, sha256 1f2e3d4c5b6a)``."""
    return (f"{identity.get('type')} {identity.get('model_file', '?')} (vocab {identity.get('vocab_size')}, "
            f"eod {identity.get('eod')}, sha256 {str(identity.get('model_sha256'))[:12]})")


def write_sidecar(prefix: str | os.PathLike[str], tokenizer: SentencePieceTokenizer,
                  num_documents: int, num_tokens: int) -> Path:
    """Record ``tokenizer`` as the one that made ``prefix`` (atomically)."""
    record = {"format_version": SIDECAR_VERSION, "tokenizer": tokenizer_identity(tokenizer),
              "num_documents": int(num_documents), "num_tokens": int(num_tokens)}
    path = sidecar_path(prefix)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def read_sidecar(prefix: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The recorded identity, or None when the dataset has no sidecar."""
    path = sidecar_path(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        identity = record["tokenizer"]
        if not all(k in identity for k in _IDENTITY_KEYS):
            raise KeyError(next(k for k in _IDENTITY_KEYS if k not in identity))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: unreadable tokenizer record ({type(e).__name__}: {e}); delete it or "
                        "re-run megapost-preprocess") from None
    return record


def tokenizer_mismatch(record: dict[str, Any], tokenizer: SentencePieceTokenizer) -> str | None:
    """None when ``tokenizer`` is the one ``record`` names, else both identities in a phrase."""
    recorded, current = record["tokenizer"], tokenizer_identity(tokenizer)
    if all(recorded[k] == current[k] for k in _IDENTITY_KEYS):
        return None
    return f"was tokenized with {describe(recorded)} but the tokenizer given is {describe(current)}"


def check_tokenizer_sidecar(prefix: str | os.PathLike[str], tokenizer: SentencePieceTokenizer,
                            num_documents: int, num_tokens: int, allow_mismatch: bool,
                            say: Any = print) -> None:
    """Refuse (DataError) data whose sidecar names another tokenizer unless ``allow_mismatch``; a
    dataset without a sidecar, or with one describing other data, gets a one-line note via ``say``."""
    record = read_sidecar(prefix)
    path = sidecar_path(prefix)
    if record is None:
        say(f" note: {prefix} has no {path.name} (made before megapost recorded tokenizers, or by "
            "Megatron-LM): only its largest token id is checked against the tokenizer")
        return
    if (record.get("num_documents"), record.get("num_tokens")) != (num_documents, num_tokens):
        say(f" note: {path} describes {record.get('num_documents')} documents / {record.get('num_tokens')} "
            f"tokens but {prefix}.idx has {num_documents} / {num_tokens}: the record is stale and ignored; "
            "re-run megapost-preprocess to renew it")
        return
    mismatch = tokenizer_mismatch(record, tokenizer)
    if mismatch is None:
        return
    if allow_mismatch:
        say(f" warning: --data-path {prefix} {mismatch}; training anyway (--allow-tokenizer-mismatch)")
        return
    raise DataError(f"--data-path {prefix} {mismatch} (--tokenizer-model {tokenizer.model_path}); pass the "
                    "tokenizer the data was built with, re-tokenize it with megapost-preprocess, or "
                    "pass --allow-tokenizer-mismatch")
