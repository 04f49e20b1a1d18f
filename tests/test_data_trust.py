"""Data that cannot silently change: the tokenizer sidecar beside a dataset, checksummed index caches."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from launch_utils import run, tiny_model_flags

from megapost.data import (
    DataError,
    IndexedDataset,
    SentencePieceTokenizer,
    build_train_valid_test_datasets,
    train_tokenizer,
)
from megapost.data.blend import Blend, DataSources
from megapost.data.tokenizer_sidecar import read_sidecar, sidecar_path
from megapost.train.prepare import check_data
from megapost.utils.checksum import file_sha256


@pytest.fixture(scope="module")
def other_tokenizer(tiny_data, tmp_path_factory) -> str:
    """Another tokenizer whose vocabulary (520) covers the tiny data's ids: only the sidecar tells them
    apart."""
    out = tmp_path_factory.mktemp("other_tok") / "other"
    return str(train_tokenizer(list(tiny_data.shards), out, vocab_size=520, byte_fallback=False))


def _args(data_path: str, tokenizer_model: str, allow: bool = False) -> argparse.Namespace:
    return argparse.Namespace(data_path=data_path, tokenizer_model=tokenizer_model,
                              allow_tokenizer_mismatch=allow, data_sources=DataSources(Blend((data_path,))))


def test_preprocessing_records_the_tokenizer(tiny_data) -> None:
    record = read_sidecar(tiny_data.prefix)
    tok = SentencePieceTokenizer(tiny_data.tokenizer_model)
    assert record is not None and record["tokenizer"] == {
        "type": "sentencepiece", "model_sha256": file_sha256(tiny_data.tokenizer_model),
        "vocab_size": tok.vocab_size, "eod": tok.eod, "model_file": Path(tiny_data.tokenizer_model).name}
    assert (record["num_documents"], record["num_tokens"]) == (tiny_data.num_documents, tiny_data.num_tokens)


def test_mismatched_tokenizer_is_refused_unless_allowed(tiny_data, other_tokenizer, capsys) -> None:
    other, right = SentencePieceTokenizer(other_tokenizer), SentencePieceTokenizer(tiny_data.tokenizer_model)
    check_data(_args(tiny_data.prefix, tiny_data.tokenizer_model), right)
    assert capsys.readouterr().out == ""  # the right tokenizer: silent
    with pytest.raises(DataError) as err:
        check_data(_args(tiny_data.prefix, other_tokenizer), other)
    message = str(err.value)
    assert "\n" not in message and "--allow-tokenizer-mismatch" in message
    assert "(vocab 512, eod 2, sha256 " in message and "(vocab 520, eod 2, sha256 " in message
    check_data(_args(tiny_data.prefix, other_tokenizer, allow=True), other)
    assert "training anyway (--allow-tokenizer-mismatch)" in capsys.readouterr().out


@pytest.mark.integration
def test_training_refuses_and_megatron_data_trains_with_a_note(tiny_data, other_tokenizer, tmp_path) -> None:
    """Through the real CLI: a one-line refusal; a dataset without sidecar (as Megatron-LM writes them)
    trains, with one note."""
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 1, "--peak-tflops": 1,
                                           "--tokenizer-model": other_tokenizer})
    proc = run([sys.executable, "-m", "megapost.pretrain", *flags], check=False, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --data-path {tiny_data.prefix} was tokenized with sentencepiece"), last
    megatron = tmp_path / "megatron_text_document"
    for ext in (".bin", ".idx"):
        shutil.copyfile(tiny_data.prefix + ext, str(megatron) + ext)
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 1, "--peak-tflops": 1, "--data-path": megatron})
    proc = run([sys.executable, "-m", "megapost.pretrain", *flags], timeout=300)
    notes = [ln for ln in proc.stdout.splitlines() if "has no megatron_text_document.tokenizer.json" in ln]
    assert len(notes) == 1 and "iteration      1/1" in proc.stdout
    assert "peak 1 TFLOP/s/device (--peak-tflops)" in proc.stdout  # the start-up line names its source


def test_stale_or_damaged_sidecar(tiny_data, tmp_path, capsys) -> None:
    prefix = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copyfile(tiny_data.prefix + ext, prefix + ext)
    record = json.loads(sidecar_path(tiny_data.prefix).read_text())
    tok = SentencePieceTokenizer(tiny_data.tokenizer_model)
    sidecar_path(prefix).write_text(json.dumps({**record, "num_documents": 3}))
    check_data(_args(prefix, tiny_data.tokenizer_model), tok)
    assert "the record is stale and ignored" in capsys.readouterr().out
    sidecar_path(prefix).write_text("{")
    with pytest.raises(DataError, match=r"copy.tokenizer.json: unreadable tokenizer record"):
        check_data(_args(prefix, tiny_data.tokenizer_model), tok)
    assert len(IndexedDataset(prefix)) == tiny_data.num_documents


def _flip(path: Path, position: int, mask: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[position] ^= mask
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind,position,mask", [
    ("sample_index", -5, 0x01),     # one bit of an offset: before the checksum, silently other data
    ("sample_index", -1, 0x40),     # a high byte: before the checksum, an IndexError
    ("shuffle_index", -3, 0x10),
    ("document_index", -4, 0x02),
])
def test_corrupted_index_cache_is_rebuilt_with_a_warning(tiny_data, tmp_path, caplog, kind, position,
                                                         mask) -> None:
    """A flipped bit in a real cached .npy is detected by its SHA-256, named, and rebuilt: the samples
    equal a fresh build's."""
    def build(cache):
        return build_train_valid_test_datasets(tiny_data.prefix, "9,1,0", seq_length=16, seed=3,
                                               train_valid_test_num_samples=(300, 20, 0), cache_dir=cache)[0]

    fresh = build(None)
    cached = build(tmp_path)
    path = cached.cache_paths(tmp_path)[kind]
    _flip(path, position, mask)
    with caplog.at_level(logging.WARNING, logger="megapost.data.gpt_dataset"):
        rebuilt = build(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"train: cached sample indices {path} does not match the SHA-256 in "
                        f"{path.name.split('-')[0]}.json; rebuilding them"]
    assert all(np.array_equal(rebuilt[i]["tokens"], fresh[i]["tokens"]) for i in range(len(fresh)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megapost.data.gpt_dataset"):
        again = build(tmp_path)  # the rebuilt cache is trusted again, silently
    assert not caplog.records and np.array_equal(again.sample_index, fresh.sample_index)


def test_index_cache_description_names_its_inputs(tiny_data, tmp_path) -> None:
    ds = build_train_valid_test_datasets(tiny_data.prefix, "1", seq_length=16, seed=3,
                                         train_valid_test_num_samples=(50, 0, 0), cache_dir=tmp_path)[0]
    description = json.loads(ds.cache_paths(tmp_path)["description"].read_text())
    assert description["built_from"]["seq_length"] == 16 and description["built_from"]["seed"] == 3
    assert description["built_from"]["num_samples"] == 50 and description["name"] == "train"
    assert description["corpus_tokens"] == tiny_data.num_tokens
    assert description["sha256"]["sample_index"] == file_sha256(ds.cache_paths(tmp_path)["sample_index"])
