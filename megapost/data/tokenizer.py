"""SentencePiece tokenizer wrapper with the ids the data pipeline needs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from megapost.data.errors import DataError


class SentencePieceTokenizer:
    """Loads a SentencePiece ``.model``; ``eod`` is its end-of-sentence id."""

    kind = "sentencepiece"

    @property
    def identity_file(self) -> Path:
        """The file whose hash identifies this tokenizer (recorded beside datasets)."""
        return self.model_path

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"tokenizer model not found: {self.model_path}; pass --tokenizer-model PATH")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        except (RuntimeError, OSError) as e:
            raise DataError(
                f"{self.model_path} is not a SentencePiece model ({str(e).splitlines()[0]}); "
                "pass a .model file from tools/train_tokenizer.py"
            ) from None
        if self._sp.eos_id() < 0:
            raise DataError(f"{self.model_path}: the SentencePiece model has no end-of-sentence id (eos)")

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad(self) -> int:
        """Pad id, or -1 when the model defines none."""
        return int(self._sp.pad_id())

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer:
    """The tokenizer of a local Hugging Face directory (``tokenizer.json`` or what ``transformers``
    loads); ``eod`` is its end-of-sequence id. Needs the ``[hf]`` extra."""

    kind = "huggingface"

    @property
    def identity_file(self) -> Path:
        json_file = self.model_path / "tokenizer.json"
        return json_file if json_file.is_file() else self.model_path / "tokenizer_config.json"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.model_path = Path(directory)
        if not self.model_path.is_dir():
            raise DataError(f"--tokenizer-model {self.model_path}: HuggingFaceTokenizer needs a local "
                            "directory holding tokenizer.json / tokenizer_config.json")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError("--tokenizer-type HuggingFaceTokenizer needs transformers: "
                            "pip install -e '.[hf]'") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise DataError(f"--tokenizer-model {self.model_path}: not a tokenizer directory ({e})") from None
        if self._tok.eos_token_id is None:
            raise DataError(f"{self.model_path}: the tokenizer defines no eos token")

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return int(self._tok.eos_token_id)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self._tok(list(texts), add_special_tokens=False)["input_ids"]]

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids]))


class NullTokenizer:
    """Megatron's NullTokenizer: data is already token ids below ``vocab_size``; eod is the last id."""

    kind, identity_file = "null", None

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise DataError(f"--vocab-size {vocab_size}: a NullTokenizer needs at least 2 ids")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.model_path = None


def build_tokenizer(kind: str, model: str | None, vocab_size: int | None = None) -> Any:
    """A tokenizer from Megatron's ``--tokenizer-type`` (SentencePiece kinds share one class)."""
    if kind == "NullTokenizer":
        return NullTokenizer(int(vocab_size or 0))
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model or "")
    return SentencePieceTokenizer(model or "")
