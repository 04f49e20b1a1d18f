"""GPTDataset indices, caching and splits; the resumable data-parallel sampler and batch iterator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megapost.data import (
    DataError,
    GPTDataset,
    IndexedDataset,
    MegatronPretrainingSampler,
    build_data_iterator,
    build_train_valid_test_datasets,
    split_document_ranges,
)

SEQ = 32


@pytest.fixture(scope="module")
def indexed(tiny_data) -> IndexedDataset:
    return IndexedDataset(tiny_data.prefix)


def _stream(indexed: IndexedDataset, document_index: np.ndarray) -> np.ndarray:
    return np.concatenate([indexed[int(d)] for d in document_index]).astype(np.int64)


def test_samples_tile_the_token_stream_with_one_token_overlap(indexed: IndexedDataset) -> None:
    doc_ids = np.arange(10, 200)
    ds = GPTDataset(indexed, doc_ids, None, SEQ, seed=3)
    assert ds.num_epochs == 1
    assert sorted(ds.document_index.tolist()) == doc_ids.tolist()
    stream = _stream(indexed, ds.document_index)
    assert len(ds) == (len(stream) - 1) // SEQ
    for i in range(len(ds)):
        assert np.array_equal(ds.sample_tokens(i), stream[i * SEQ : i * SEQ + SEQ + 1])
    item = ds[5]
    assert item["tokens"].dtype == np.int64 and item["tokens"].shape == (SEQ + 1,)
    assert np.array_equal(item["tokens"], ds.sample_tokens(int(ds.shuffle_index[5])))
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_epochs_shuffle_jointly_and_a_short_last_epoch_apart(indexed: IndexedDataset) -> None:
    """megatron-core's rule: documents of all epochs are shuffled together, except a last epoch
    holding < 80% of an epoch's samples, shuffled on its own (tests/test_megatron_order.py checks
    the exact order against megatron-core itself)."""
    doc_ids = np.arange(0, 40)
    one_epoch = GPTDataset(indexed, doc_ids, None, SEQ, seed=1).num_samples
    ds = GPTDataset(indexed, doc_ids, 2 * one_epoch + 3, SEQ, seed=1)  # the third epoch is short
    assert ds.num_epochs == 3 and len(ds) == 2 * one_epoch + 3
    head, last = ds.document_index[:80], ds.document_index[80:]
    assert sorted(head.tolist()) == sorted(2 * doc_ids.tolist()) and sorted(last.tolist()) == doc_ids.tolist()
    assert sorted(head[:40].tolist()) != doc_ids.tolist()  # epochs 1 and 2 mixed, not one after the other
    stream = _stream(indexed, ds.document_index)
    for i in (0, one_epoch, len(ds.sample_index) - 2):
        assert np.array_equal(ds.sample_tokens(i), stream[i * SEQ : i * SEQ + SEQ + 1])
    first_two = (2 * ds.tokens_per_epoch - 1) // SEQ
    assert sorted(ds.shuffle_index[:first_two].tolist()) == list(range(first_two))
    long_last = GPTDataset(indexed, doc_ids, 3 * one_epoch, SEQ, seed=1)  # a full third epoch: joint
    assert sorted(long_last.document_index[:40].tolist()) != doc_ids.tolist()
    assert sorted(long_last.shuffle_index[:first_two].tolist()) != list(range(first_two))


def test_order_is_a_function_of_the_seed(indexed: IndexedDataset) -> None:
    doc_ids = np.arange(0, 200)
    a, b, c = (GPTDataset(indexed, doc_ids, 100, SEQ, seed=s) for s in (7, 7, 8))
    for kind in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(a, kind), getattr(b, kind))
    assert [a[i]["tokens"].tolist() for i in range(10)] == [b[i]["tokens"].tolist() for i in range(10)]
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_cache_hit_returns_identical_indices(
    indexed: IndexedDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc_ids = np.arange(0, 200)
    built = GPTDataset(indexed, doc_ids, 150, SEQ, seed=5, cache_dir=tmp_path, name="train")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 4 and all(f.startswith(f"train_{built.hash[:24]}") for f in files)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}

    def no_build(self: GPTDataset) -> None:
        raise AssertionError("indices were rebuilt instead of loaded from the cache")

    monkeypatch.setattr(GPTDataset, "_build", no_build)
    loaded = GPTDataset(indexed, doc_ids, 150, SEQ, seed=5, cache_dir=tmp_path, name="train")
    for kind in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(built, kind), getattr(loaded, kind))
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps
    monkeypatch.undo()
    shuffle_file = built.cache_paths(tmp_path)["shuffle_index"]
    shuffle_file.write_bytes(shuffle_file.read_bytes()[:100])  # a damaged entry is rebuilt, not trusted
    rebuilt = GPTDataset(indexed, doc_ids, 150, SEQ, seed=5, cache_dir=tmp_path, name="train")
    assert np.array_equal(rebuilt.shuffle_index, built.shuffle_index)
    assert np.array_equal(np.load(shuffle_file), built.shuffle_index)
    monkeypatch.setattr(GPTDataset, "_build", no_build)
    # anything that changes the indices changes the key
    for args in ((doc_ids[1:], 150, SEQ, 5), (doc_ids, 151, SEQ, 5), (doc_ids, 150, SEQ + 1, 5),
                 (doc_ids, 150, SEQ, 6)):
        with pytest.raises(AssertionError, match="rebuilt"):
            GPTDataset(indexed, *args, cache_dir=tmp_path, name="train")


def test_split_document_ranges() -> None:
    assert split_document_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(10, "8/2") == [(0, 8), (8, 10), (10, 10)]
    assert split_document_ranges(7, [1, 1, 1]) == [(0, 2), (2, 5), (5, 7)]
    with pytest.raises(DataError, match="--split"):
        split_document_ranges(10, "a,b")


def test_build_train_valid_test_datasets(tiny_data, tmp_path: Path) -> None:
    train, valid, test = build_train_valid_test_datasets(
        tiny_data.prefix, "80,15,5", seq_length=SEQ, seed=1, train_valid_test_num_samples=[300, 20, 4],
        cache_dir=tmp_path,
    )
    n = tiny_data.num_documents
    assert train.doc_ids.tolist() == list(range(0, round(0.8 * n)))
    assert valid.doc_ids.tolist() == list(range(round(0.8 * n), round(0.95 * n)))
    assert test.doc_ids.tolist() == list(range(round(0.95 * n), n))
    assert (len(train), len(valid), len(test)) == (300, 20, 4)
    assert train.num_epochs > 1  # 300 samples need more than one pass over the train documents
    assert {d.name for d in (train, valid, test)} == {"train", "valid", "test"}

    _, valid, test = build_train_valid_test_datasets(
        tiny_data.prefix, "969,30,1", seq_length=SEQ, seed=1, train_valid_test_num_samples=[10, 0, 5]
    )
    assert valid is None  # 0 samples asked
    assert test is None  # round(0.001 * 240) = 0 documents: skipped with a warning
    _, _, test = build_train_valid_test_datasets(
        tiny_data.prefix, "1,0,0", seq_length=SEQ, seed=1, train_valid_test_num_samples=[10, 5, 5]
    )
    assert test is None
    with pytest.raises(DataError, match="the train split .* has no documents"):
        build_train_valid_test_datasets(
            tiny_data.prefix, "1,1000,0", seq_length=SEQ, seed=1, train_valid_test_num_samples=[10, 5, 0]
        )


def test_sequence_longer_than_the_data(tiny_data) -> None:
    tokens = tiny_data.num_tokens
    message = f"sequence longer than the data allows: --seq-length {tokens} .* has only {tokens} tokens"
    with pytest.raises(DataError, match=message):
        build_train_valid_test_datasets(
            tiny_data.prefix, "1,0,0", seq_length=tokens, seed=1, train_valid_test_num_samples=[1, 0, 0]
        )
    with pytest.raises(DataError, match="--seq-length 400 .* valid split"):
        build_train_valid_test_datasets(
            tiny_data.prefix, "239,1,0", seq_length=400, seed=1, train_valid_test_num_samples=[1, 1, 0]
        )


def _run(
    total: int, consumed: int, mbs: int, rank: int, dp: int, steps: int | None = None
) -> list[list[int]]:
    sampler = MegatronPretrainingSampler(total, consumed, mbs, rank, dp, infinite=steps is not None)
    out = []
    for batch in sampler:
        out.append(batch)
        if steps is not None and len(out) == steps:
            break
    return out


def test_sampler_resume_and_data_parallel_coverage() -> None:
    total, mbs, dp = 103, 3, 2
    per_rank = [_run(total, 0, mbs, r, dp) for r in range(dp)]
    assert len(per_rank[0]) == len(per_rank[1]) == total // (mbs * dp)  # last partial batch dropped
    for step, batches in enumerate(zip(*per_rank, strict=True)):
        merged = [i for b in batches for i in b]
        assert merged == list(range(step * mbs * dp, (step + 1) * mbs * dp))
    for k in (6, 42, 96):
        for r in range(dp):
            assert _run(total, k, mbs, r, dp) == per_rank[r][k // (mbs * dp) :]
    # wrapping: global position p is sample p % total, so a resume past the end still continues exactly
    endless = _run(total, 0, mbs, 1, dp, steps=40)
    assert endless[17] == [(17 * 6 + 3 + j) % total for j in range(3)]
    assert _run(total, 30 * 6, mbs, 1, dp, steps=10) == endless[30:]
    with pytest.raises(ValueError):
        MegatronPretrainingSampler(total, total, mbs, 0, dp)
    with pytest.raises(ValueError):
        MegatronPretrainingSampler(total, 0, mbs, 2, dp)


def test_data_iterator_batches_and_resume(indexed: IndexedDataset) -> None:
    ds = GPTDataset(indexed, np.arange(0, 200), 64, SEQ, seed=2)
    it = build_data_iterator(ds, 0, micro_batch_size=4, dp_rank=1, dp_size=2)
    batches = [next(it) for _ in range(20)]  # 20 * 8 = 160 > 64 samples: wraps around
    assert it.consumed_samples == 160
    batch = batches[0]
    assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (4, SEQ)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
    sample = torch.from_numpy(ds[4]["tokens"])  # rank 1 of 2 gets samples 4..7 of the first global batch
    assert torch.equal(batch["tokens"][0], sample[:-1]) and torch.equal(batch["labels"][0], sample[1:])
    resumed = build_data_iterator(ds, 7 * 8, micro_batch_size=4, dp_rank=1, dp_size=2)
    for expected in batches[7:]:
        got = next(resumed)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
