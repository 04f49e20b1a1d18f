"""SentencePiece tokenizer wrapper with the ids the data pipeline needs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from megapost.data.errors import DataError


class SentencePieceTokenizer:
    """Loads a SentencePiece ``.model``; ``eod`` is its end-of-sentence id."""

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
