"""Tokenize JSON-lines / HF datasets into Megatron ``.bin``/``.idx`` files, one pair per JSON key."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult, Pool
from typing import TypeVar

import numpy as np
from tqdm import tqdm

from megapost.data.errors import DataError
from megapost.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megapost.data.json_sources import (
    Chunk,
    expand_inputs,
    iter_hf_chunks,
    iter_input_chunks,
    load_hf_dataset,
    parse_record,
    record_size,
)
from megapost.data.tokenizer import SentencePieceTokenizer
from megapost.data.tokenizer_sidecar import sidecar_path, write_sidecar

# A record's result: token arrays per key, or the one-line reason it is bad.
RecordResult = dict[str, np.ndarray] | str
BAD_LINE_EXAMPLES = 5  # skipped lines quoted (file:line: reason) in the summary
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class PreprocessStats:
    """What a preprocessing run wrote."""

    outputs: dict[str, str]
    documents: dict[str, int]
    tokens: dict[str, int]
    empty_documents: dict[str, int]
    skipped_lines: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    bad_line_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"{key}: {self.documents[key]:,} documents, {self.tokens[key]:,} tokens "
            f"({self.empty_documents[key]:,} empty skipped) -> {self.outputs[key]}.bin/.idx/.tokenizer.json"
            for key in self.outputs
        ]
        lines.append(
            f"skipped bad lines: {self.skipped_lines:,}; input {self.input_bytes / 1e6:.1f} MB "
            f"in {self.seconds:.1f} s"
        )
        if self.bad_line_examples:
            more = self.skipped_lines - len(self.bad_line_examples)
            hidden = f" ({more:,} more not shown)" if more else ""
            lines.append(f"first {len(self.bad_line_examples)} skipped{hidden}:")
            lines.extend(f"  {example}" for example in self.bad_line_examples)
        return "\n".join(lines)


def output_prefix_for(output_prefix: str | os.PathLike[str], key: str) -> str:
    """Megatron's naming: ``<output-prefix>_<key>_document``."""
    return f"{os.fspath(output_prefix)}_{key}_document"


class _Encoder:
    """Parses and tokenizes chunks; one instance per worker process."""

    def __init__(
        self, tokenizer: SentencePieceTokenizer, keys: Sequence[str], append_eod: bool, dtype: np.dtype
    ) -> None:
        self.tokenizer = tokenizer
        self.keys = list(keys)
        self.append_eod = append_eod
        self.dtype = dtype

    def encode(self, chunk: Chunk) -> tuple[list[RecordResult], int]:
        results: list[RecordResult] = []
        texts: dict[str, list[str]] = {k: [] for k in self.keys}
        good: list[int] = []
        for number, record in chunk.records:
            try:
                parsed = parse_record(record, self.keys, chunk.where(number))
            except DataError as e:
                results.append(str(e))
                continue
            good.append(len(results))
            results.append({})
            for k in self.keys:
                texts[k].append(parsed[k])
        for k in self.keys:
            for slot, ids in zip(good, self.tokenizer.tokenize_batch(texts[k]), strict=True):
                if ids and self.append_eod:
                    ids.append(self.tokenizer.eod)
                results[slot][k] = np.asarray(ids, dtype=self.dtype)
        return results, sum(record_size(r) for _, r in chunk.records)


_worker_encoder: _Encoder | None = None


def _init_worker(tokenizer_model: str, keys: Sequence[str], append_eod: bool, dtype: np.dtype) -> None:
    global _worker_encoder
    # a forked worker inherits the parent's signal handlers (megapost's trainer defers or ignores
    # SIGTERM): restore the default so that Pool.terminate() always ends it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = _Encoder(SentencePieceTokenizer(tokenizer_model), keys, append_eod, dtype)


def _encode_in_worker(chunk: Chunk) -> tuple[list[RecordResult], int]:
    assert _worker_encoder is not None
    return _worker_encoder.encode(chunk)


def _ordered_bounded_map(
    pool: Pool, func: Callable[[T], R], items: Iterable[T], max_pending: int
) -> Iterator[R]:
    """``pool.imap`` that reads ``items`` at most ``max_pending`` ahead (imap would read them all)."""
    pending: deque[AsyncResult[R]] = deque()
    for item in items:
        pending.append(pool.apply_async(func, (item,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _pool_context() -> multiprocessing.context.BaseContext:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def preprocess(
    inputs: Sequence[str | os.PathLike[str]] = (),
    *,
    output_prefix: str | os.PathLike[str],
    tokenizer_model: str | os.PathLike[str],
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_lines: bool = False,
    hf_dataset: str | None = None,
    hf_split: str = "train",
    chunk_size: int = 128,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> PreprocessStats:
    """Tokenize every document of ``inputs`` (and/or ``hf_dataset``) into ``<output_prefix>_<key>_document``.

    Document order follows the inputs (globs sorted) whatever ``workers`` is.  A bad record (invalid
    UTF-8, malformed JSON, missing key) raises DataError naming file:line unless ``skip_bad_lines``,
    which counts it.  Documents without tokens are skipped.  Outputs appear only when complete; each
``.bin``/``.idx`` pair gets a ``.tokenizer.json`` sidecar naming the tokenizer (tokenizer_sidecar).
    """
    if not inputs and hf_dataset is None:
        raise DataError("no input given; pass --input FILE/GLOB or --hf-dataset NAME")
    if not json_keys:
        raise DataError("--json-keys needs at least one key")
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    paths = expand_inputs(inputs) if inputs else []
    tokenizer = SentencePieceTokenizer(tokenizer_model)
    dtype = best_dtype(tokenizer.vocab_size)
    hf = load_hf_dataset(hf_dataset, hf_split) if hf_dataset is not None else None

    def chunks() -> Iterator[Chunk]:
        yield from iter_input_chunks(paths, json_keys, chunk_size, hf_split)
        if hf is not None:
            yield from iter_hf_chunks(hf, str(hf_dataset), json_keys, chunk_size)

    keys = list(json_keys)
    outputs = {k: output_prefix_for(output_prefix, k) for k in keys}
    stats = PreprocessStats(outputs, dict.fromkeys(keys, 0), dict.fromkeys(keys, 0), dict.fromkeys(keys, 0))
    start = time.perf_counter()
    builders = {k: IndexedDatasetBuilder(outputs[k], dtype) for k in keys}
    pool = None
    try:
        if workers > 1:
            pool = _pool_context().Pool(
                workers, initializer=_init_worker, initargs=(str(tokenizer_model), keys, append_eod, dtype)
            )
            encoded = _ordered_bounded_map(pool, _encode_in_worker, chunks(), 4 * workers)
        else:
            encoder = _Encoder(tokenizer, keys, append_eod, dtype)
            encoded = map(encoder.encode, chunks())
        bar_options = {"desc": "tokenizing", "unit": " docs", "unit_scale": True, "mininterval": 0.5}
        with tqdm(disable=not progress, **bar_options) as bar:
            for results, nbytes in encoded:
                _write_results(results, builders, stats, skip_bad_lines)
                stats.input_bytes += nbytes
                bar.update(len(results))
                seconds = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"{stats.input_bytes / 1e6 / seconds:.1f} MB/s")
        _finalize(builders, outputs, tokenizer, stats)
    except BaseException:
        for builder in builders.values():
            if not builder.closed:
                builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    stats.seconds = time.perf_counter() - start
    if log is not None:
        log(stats.summary())
    return stats


def _finalize(builders: dict[str, IndexedDatasetBuilder], outputs: dict[str, str],
              tokenizer: SentencePieceTokenizer, stats: PreprocessStats) -> None:
    """Refuse an empty corpus, else write every key's ``.bin``/``.idx`` and its tokenizer sidecar."""
    for k in builders:
        if stats.documents[k] == 0:
            raise DataError(
                f"empty corpus: no document with text in field {k!r} was found in the inputs "
                f"({stats.skipped_lines} bad lines skipped); check --input and --json-keys"
            )
    for k, builder in builders.items():
        sidecar_path(outputs[k]).unlink(missing_ok=True)  # never pair new data with an old record
        builder.finalize()
        write_sidecar(outputs[k], tokenizer, stats.documents[k], stats.tokens[k])


def _write_results(
    results: list[RecordResult],
    builders: dict[str, IndexedDatasetBuilder],
    stats: PreprocessStats,
    skip_bad_lines: bool,
) -> None:
    for result in results:
        if isinstance(result, str):
            if not skip_bad_lines:
                raise DataError(f"{result}; fix the line or pass --skip-bad-lines")
            stats.skipped_lines += 1
            if len(stats.bad_line_examples) < BAD_LINE_EXAMPLES:
                stats.bad_line_examples.append(result)
            continue
        for key, tokens in result.items():
            if len(tokens) == 0:
                stats.empty_documents[key] += 1
                continue
            builders[key].add_document(tokens)
            stats.documents[key] += 1
            stats.tokens[key] += len(tokens)

