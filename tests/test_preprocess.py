"""Preprocessing inputs/outputs/errors, the CLI tools, and the default corpus."""

from __future__ import annotations

import filecmp
import gzip
import importlib.util
import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from conftest import write_jsonl

from megapost.data import DataError, IndexedDataset, SentencePieceTokenizer, preprocess
from megapost.data.default_corpus import outputs_valid, prepare_default_data
from megapost.data.tokenizer_sidecar import read_sidecar, sidecar_path
from megapost.utils.checksum import file_sha256

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(inputs: list[str], out: Path, tiny_data, **kwargs) -> str:
    kwargs = {"append_eod": True, "progress": False, "log": None, **kwargs}
    stats = preprocess(inputs, output_prefix=out, tokenizer_model=tiny_data.tokenizer_model, **kwargs)
    return stats.outputs["text"]


def _docs(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def _same_files(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


def test_tokens_decode_to_the_input_texts(tiny_data) -> None:
    tok = SentencePieceTokenizer(tiny_data.tokenizer_model)
    docs = _docs(tiny_data.prefix)
    assert len(docs) == len(tiny_data.texts) == tiny_data.num_documents
    for ids, text in zip(docs, tiny_data.texts, strict=True):
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == text
    assert IndexedDataset(tiny_data.prefix).dtype == np.uint16


def test_json_jsonl_gz_and_glob_inputs_agree(tiny_data, tmp_path: Path) -> None:
    texts = list(tiny_data.texts[:30])
    write_jsonl(tmp_path / "a.jsonl", texts)
    write_jsonl(tmp_path / "a.json", texts)
    with gzip.open(tmp_path / "c4-train.00000-of-00002.json.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t, "url": "u"}) + "\n" for t in texts[:10])
    with gzip.open(tmp_path / "c4-train.00001-of-00002.json.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n\n" for t in texts[10:])  # blank lines are ignored
    ref = _run([str(tmp_path / "a.jsonl")], tmp_path / "o1", tiny_data)
    assert _same_files(ref, _run([str(tmp_path / "a.json")], tmp_path / "o2", tiny_data))
    glob = _run([str(tmp_path / "c4-train.*-of-00002.json.gz")], tmp_path / "o3", tiny_data)
    assert _same_files(ref, glob)
    assert _docs(ref) == _docs(tiny_data.prefix)[:30]
    both = _run([str(tmp_path / "a.json"), str(tmp_path / "a.jsonl")], tmp_path / "o4", tiny_data)
    assert _docs(both) == _docs(ref) * 2


def test_workers_give_byte_identical_output(tiny_data, tmp_path: Path) -> None:
    one = _run(list(tiny_data.shards), tmp_path / "w1", tiny_data, workers=1, chunk_size=7)
    two = _run(list(tiny_data.shards), tmp_path / "w2", tiny_data, workers=2, chunk_size=7)
    assert _same_files(one, two) and _same_files(one, tiny_data.prefix)


def test_hf_saved_dataset_inputs(tiny_data, tmp_path: Path) -> None:
    import datasets

    texts = list(tiny_data.texts[:20])
    table = datasets.Dataset.from_dict({"text": texts, "id": list(range(20))})
    table.save_to_disk(str(tmp_path / "saved"))
    splits = datasets.DatasetDict({"train": table, "validation": table.select(range(5))})
    splits.save_to_disk(str(tmp_path / "dd"))
    expected = _docs(tiny_data.prefix)[:20]
    assert _docs(_run([str(tmp_path / "saved")], tmp_path / "o1", tiny_data)) == expected
    assert _docs(_run([], tmp_path / "o2", tiny_data, hf_dataset=str(tmp_path / "saved"))) == expected
    val = _run([], tmp_path / "o3", tiny_data, hf_dataset=str(tmp_path / "dd"), hf_split="validation")
    assert _docs(val) == expected[:5]
    with pytest.raises(DataError, match="no split 'test'"):
        _run([], tmp_path / "o4", tiny_data, hf_dataset=str(tmp_path / "dd"), hf_split="test")


def test_multiple_json_keys_write_one_pair_each(tiny_data, tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    path.write_text("".join(json.dumps({"text": t, "title": t[:20]}) + "\n" for t in tiny_data.texts[:5]))
    stats = preprocess([str(path)], output_prefix=tmp_path / "kv", tokenizer_model=tiny_data.tokenizer_model,
                       json_keys=["text", "title"], progress=False, log=None)
    assert stats.outputs == {"text": f"{tmp_path}/kv_text_document", "title": f"{tmp_path}/kv_title_document"}
    assert stats.documents == {"text": 5, "title": 5}
    assert len(_docs(stats.outputs["title"])[0]) < len(_docs(stats.outputs["text"])[0])


def _bad_corpus(tmp_path: Path, texts: list[str]) -> Path:
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": t}).encode() for t in texts[:6]]
    lines[2] = b'{"text": "unterminated'
    lines[4] = json.dumps({"text": "caf\u00e9"}).encode().replace(b"\\u00e9", b"\xe9")  # latin-1 byte
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_lines_raise_with_file_and_line_and_leave_no_output(tiny_data, tmp_path: Path) -> None:
    path = _bad_corpus(tmp_path, list(tiny_data.texts))
    with pytest.raises(DataError, match=rf"{path}:3: malformed JSON .*--skip-bad-lines") as err:
        _run([str(path)], tmp_path / "out", tiny_data)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no outputs, no temp files
    path.write_bytes(path.read_bytes().replace(b'{"text": "unterminated', b'{"text": "fine"}'))
    with pytest.raises(DataError, match=rf"{path}:5: not valid UTF-8"):
        _run([str(path)], tmp_path / "out", tiny_data, workers=2, chunk_size=2)
    path.write_bytes(b'{"text": "ok"}\n\n[1, 2]\n{"title": "x"}\n')
    with pytest.raises(DataError, match=rf"{path}:3: expected a JSON object per line, got list"):
        _run([str(path)], tmp_path / "out", tiny_data)
    path.write_bytes(b'{"text": "ok"}\n\n{"title": "x"}\n')
    with pytest.raises(DataError, match=rf"{path}:3: field 'text' is missing"):
        _run([str(path)], tmp_path / "out", tiny_data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_skip_bad_lines_counts_them(tiny_data, tmp_path: Path) -> None:
    path = _bad_corpus(tmp_path, list(tiny_data.texts))
    stats = preprocess([str(path)], output_prefix=tmp_path / "out", tokenizer_model=tiny_data.tokenizer_model,
                       skip_bad_lines=True, append_eod=True, progress=False, log=None)
    assert stats.skipped_lines == 2 and stats.documents["text"] == 4
    assert "skipped bad lines: 2" in stats.summary()
    good = [d for i, d in enumerate(_docs(tiny_data.prefix)[:6]) if i not in (2, 4)]
    assert _docs(stats.outputs["text"]) == good


def test_empty_corpus_and_missing_files(tiny_data, tmp_path: Path) -> None:
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "empty_texts.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    for name in ("blank.jsonl", "empty_texts.jsonl"):
        with pytest.raises(DataError, match="empty corpus"):
            _run([str(tmp_path / name)], tmp_path / "out", tiny_data)
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))
    with pytest.raises(DataError, match="input not found: .*nope"):
        _run([str(tmp_path / "nope*.json.gz")], tmp_path / "out", tiny_data)
    shard = tiny_data.shards[0]
    with pytest.raises(DataError, match="tokenizer model not found: .*missing.model"):
        preprocess([shard], output_prefix=tmp_path / "o", tokenizer_model=tmp_path / "missing.model")
    with pytest.raises(DataError, match="is not a SentencePiece model"):
        preprocess([shard], output_prefix=tmp_path / "o", tokenizer_model=shard)
    with pytest.raises(DataError, match="unsupported file type"):
        _run([tiny_data.tokenizer_model], tmp_path / "o", tiny_data)


@pytest.mark.integration
def test_cli_exit_codes_and_messages(tiny_data, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(tmp_path / "x.json"),
         "--output-prefix", str(tmp_path / "o"), "--tokenizer-model", tiny_data.tokenizer_model],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr == f"error: input not found: {tmp_path / 'x.json'}\n"
    cli = _tool("preprocess_data")
    argv = ["--input", *tiny_data.shards, "--output-prefix", str(tmp_path / "cli"), "--tokenizer-model",
            tiny_data.tokenizer_model, "--append-eod", "--workers", "2", "--no-progress"]
    assert cli.main(argv) == 0
    assert "240 documents" in capsys.readouterr().out
    assert _same_files(f"{tmp_path}/cli_text_document", tiny_data.prefix)

    train = _tool("train_tokenizer")
    assert train.main(["--input", *tiny_data.shards, "--output-prefix", str(tmp_path / "bpe"),
                       "--vocab-size", "300"]) == 0
    assert SentencePieceTokenizer(tmp_path / "bpe.model").vocab_size == 300
    assert train.main(["--input", str(tmp_path / "none.json"), "--output-prefix", str(tmp_path / "b")]) == 2
    assert "error: input not found" in capsys.readouterr().err


@pytest.mark.integration
def test_prepare_default_data(tmp_path: Path) -> None:
    start = time.perf_counter()
    prefix, tokenizer_path = prepare_default_data(tmp_path, progress=False, log=None)
    ds = IndexedDataset(prefix)
    tok = SentencePieceTokenizer(tokenizer_path)
    # 3,824 pages in NewsArticles.zip; one (article 1827) has no title, subtitle or text
    assert len(ds) == 3823 and ds.num_documents == 3823
    assert tok.vocab_size == 32000 and (tok.bos, tok.eod) == (1, 2) and ds.dtype == np.uint16
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack_from("<QBQQ", raw, 9) == (1, 8, 3823, 3824)
    ends = ds.sequence_pointers // 2 + ds.sequence_lengths - 1
    assert bool((ds.tokens[ends] == tok.eod).all()) and int(ds.tokens.max()) < 32000
    assert tok.detokenize(ds[0][:-1]).startswith("Betsy DeVos Confirmed as Education Secretary")
    assert 2_500_000 < ds.num_tokens < 3_500_000

    shards = sorted((tmp_path / "news").glob("c4-news.*-of-00004.json.gz"))
    assert [p.name for p in shards] == [f"c4-news.{k:05d}-of-00004.json.gz" for k in range(4)]
    records = [json.loads(line) for p in shards for line in gzip.open(p, "rt", encoding="utf-8")]
    assert len(records) == 3823 and set(records[0]) == {"text", "timestamp", "url"}
    assert records[0]["timestamp"] == "2017-02-07T00:00:00Z" and records[0]["url"].startswith("http://abcnews")
    build_seconds = time.perf_counter() - start

    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    start = time.perf_counter()
    assert prepare_default_data(tmp_path, log=None) == (prefix, tokenizer_path)
    assert time.perf_counter() - start < min(1.0, build_seconds / 3)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == stamps  # idempotent: nothing rewritten

    record = read_sidecar(prefix)  # the default corpus names its tokenizer too
    assert record["tokenizer"]["vocab_size"] == 32000 and record["tokenizer"]["eod"] == 2
    assert record["tokenizer"]["model_sha256"] == file_sha256(tokenizer_path)
    sidecar_path(prefix).unlink()  # a corpus built before sidecars existed gets one, without a rebuild
    assert prepare_default_data(tmp_path, log=None) == (prefix, tokenizer_path)
    bin_path = Path(prefix + ".bin")
    assert read_sidecar(prefix) == record and bin_path.stat().st_mtime_ns == stamps[bin_path]

    assert outputs_valid(prefix, tokenizer_path)
    with open(prefix + ".bin", "r+b") as f:  # a damaged output is not taken as done
        f.truncate(100)
    assert not outputs_valid(prefix, tokenizer_path)


def test_null_field_and_skipped_line_examples(tiny_data, tmp_path: Path) -> None:
    path = tmp_path / "nulls.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": null}\n')
    with pytest.raises(DataError, match=rf"{path}:2: field 'text' is null"):
        _run([str(path)], tmp_path / "out", tiny_data)
    lines = [b'{"text": "ok"}'] + [b'{"text": null}', b"{bad", b'{"title": "x"}'] * 3
    path.write_bytes(b"\n".join(lines) + b"\n")
    stats = preprocess([str(path)], output_prefix=tmp_path / "out", tokenizer_model=tiny_data.tokenizer_model,
                       skip_bad_lines=True, progress=False, log=None)
    summary = stats.summary().splitlines()
    assert stats.skipped_lines == 9 and "skipped bad lines: 9" in summary[1]
    assert summary[2] == "first 5 skipped (4 more not shown):"
    assert summary[3:] == [f"  {path}:2: field 'text' is null", f"  {path}:3: malformed JSON "
                           "(Expecting property name enclosed in double quotes at column 2)",
                           f"  {path}:4: field 'text' is missing", f"  {path}:5: field 'text' is null",
                           f"  {path}:6: malformed JSON (Expecting property name enclosed in double quotes "
                           "at column 2)"]


@pytest.mark.integration
def test_rerun_removes_stale_temporaries_of_dead_writers(tiny_data, tmp_path: Path) -> None:
    """A killed run leaves ``.<out>.bin.tmp-<pid>``; the next run removes it, not a live writer's."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        stale = tmp_path / f".out_text_document.bin.tmp-{dead_pid}"
        stale_idx = tmp_path / f".out_text_document.idx.tmp-{dead_pid}"
        alive = tmp_path / f".out_text_document.bin.tmp-{live.pid}"
        other = tmp_path / f".unrelated.bin.tmp-{dead_pid}"
        for p in (stale, stale_idx, alive, other):
            p.write_bytes(b"\0" * 1000)
        _run(list(tiny_data.shards), tmp_path / "out", tiny_data)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted([alive.name, other.name, "out_text_document.bin", "out_text_document.idx",
                                "out_text_document.tokenizer.json"])
    finally:
        live.kill()
        live.wait()
