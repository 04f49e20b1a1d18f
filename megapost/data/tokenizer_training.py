"""Train a SentencePiece BPE tokenizer from the text of JSON-lines shards."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from megapost.data.errors import DataError
from megapost.data.json_sources import expand_inputs, iter_input_chunks, parse_record
from megapost.utils.atomic import atomic_write_bytes


def iter_texts(inputs: Sequence[str | os.PathLike[str]], json_key: str = "text") -> Iterator[str]:
    """The ``json_key`` text of every record of ``inputs`` (bad records raise DataError)."""
    for chunk in iter_input_chunks(expand_inputs(inputs), [json_key], chunk_size=1024):
        for number, record in chunk.records:
            yield parse_record(record, [json_key], chunk.where(number))[json_key]


def _training_lines(texts: Iterator[str]) -> Iterator[str]:
    """Non-empty lines of the documents (SentencePiece trains on sentences, not whole documents)."""
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                yield line


def train_tokenizer(
    inputs: Sequence[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    vocab_size: int = 8000,
    json_key: str = "text",
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    byte_fallback: bool = True,
    max_sentences: int = 2_000_000,
) -> Path:
    """Train on the texts of ``inputs`` and write ``<output_prefix>.model`` atomically; returns its path.

    Ids follow Llama's convention: unk 0, bos 1, eos 2, no pad.
    """
    model_path = Path(f"{os.fspath(output_prefix)}.model")
    lines = _training_lines(iter_texts(inputs, json_key))
    first = next(lines, None)
    if first is None:
        raise DataError(f"no text in field {json_key!r} of the inputs; cannot train a tokenizer")

    def sentences() -> Iterator[str]:
        yield first
        yield from lines

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            max_sentence_length=1 << 16,
            hard_vocab_limit=False,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(f"SentencePiece training failed: {str(e).strip().splitlines()[0]}") from None
    atomic_write_bytes(model_path, model.getvalue())
    return model_path
