"""megapost's sample order equals megatron-core's GPTDataset / BlendedDataset (megatron-core itself,
installed by the dev extra): one epoch, several epochs (joint shuffle, separate short last epoch),
weighted blends, blends weighted by size, and per-split data paths."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from megapost.data import IndexedDatasetBuilder
from megapost.data.blend import Blend, DataSources, build_datasets, parse_blend
from megapost.data.errors import DataError

mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset", reason="megatron-core (dev extra)")
logging.getLogger("megatron").setLevel(logging.WARNING)
SEQ, SEED, SPLIT = 32, 1234, "969,31,0"  # an empty test split would hang megatron-core


class _Tokenizer:  # the fields megatron-core's config reads; ids do not affect the indices
    eod, pad, vocab_size = 0, 1, 1000
    unique_identifiers = {"class": "test"}


def _corpus(path: Path, docs: int, seed: int) -> str:
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(str(path), dtype=np.uint16)
    for _ in range(docs):
        builder.add_document(rng.randint(2, 1000, size=rng.randint(5, 60)))
    builder.finalize()
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("order")
    specs = (("a", 200, 0), ("b", 120, 1), ("c", 80, 2))
    return [_corpus(d / name, docs, seed) for name, docs, seed in specs]


def _megatron(sizes: list[int], **blend: object) -> list[object]:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    cfg = mcore.GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, tokenizer=_Tokenizer(),
                                 reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                 mmap_bin_files=True, path_to_cache=None, **blend)
    return BlendedMegatronDatasetBuilder(mcore.GPTDataset, sizes, lambda: True, cfg).build()


def _same_samples(theirs: object, ours: object, count: int = 200) -> int:
    """How many of the first ``count`` samples hold the same tokens (megatron drops the last label)."""
    n = min(count, len(ours))
    return sum(np.array_equal(np.asarray(theirs[i]["tokens"]), ours[i]["tokens"][:-1]) for i in range(n))


def _assert_same_gpt(theirs: object, ours: object) -> None:
    assert np.array_equal(theirs.document_index, ours.document_index)
    assert np.array_equal(theirs.sample_index, ours.sample_index)
    assert np.array_equal(theirs.shuffle_index, ours.shuffle_index)
    assert _same_samples(theirs, ours) == min(200, len(ours))


EPOCHS = (0.3, 1.5, 2.3, 2.9, 4.95)  # the last epoch short (shuffled apart) at 1.5 and 2.3, long at 2.9, 4.95


def _samples_per_epoch(prefix: str) -> int:
    one = build_datasets(DataSources(blend=Blend((prefix,))), SPLIT, seq_length=SEQ, seed=SEED,
                         sizes=[None, 0, 0])[0]
    return len(one)


@pytest.mark.parametrize("epochs", EPOCHS)
def test_single_source_order_equals_megatron_core(corpora: list[str], epochs: float) -> None:
    sizes = [int(epochs * _samples_per_epoch(corpora[0])), 16, 0]
    theirs = _megatron(sizes, blend=([corpora[0]], None), split=SPLIT)
    ours = build_datasets(DataSources(blend=Blend((corpora[0],))), SPLIT, seq_length=SEQ, seed=SEED,
                          sizes=sizes)
    for split in (0, 1):
        _assert_same_gpt(theirs[split], ours[split])


def test_both_final_epoch_rules_are_exercised(corpora: list[str]) -> None:
    """EPOCHS covers a last epoch shuffled with the others and one shuffled apart."""
    from megapost.data.gpt_indices import separate_final_epoch

    rules = set()
    for epochs in EPOCHS[1:]:
        n = int(epochs * _samples_per_epoch(corpora[0]))
        ours = build_datasets(DataSources(blend=Blend((corpora[0],))), SPLIT, seq_length=SEQ, seed=SEED,
                              sizes=[n, 0, 0])[0]
        rules.add(separate_final_epoch(ours.tokens_per_epoch, SEQ, ours.num_epochs, n))
    assert rules == {True, False}


@pytest.mark.parametrize("weights", [(0.3, 0.7), None])
@pytest.mark.parametrize("num_samples", [100, 700])
def test_blend_order_equals_megatron_core(corpora: list[str], weights: tuple[float, ...] | None,
                                          num_samples: int) -> None:
    prefixes = corpora if weights is None else corpora[:2]
    if weights is None and num_samples > 300:
        num_samples = 300  # by size: at most one epoch of every source
    sizes = [num_samples, 20, 0]
    theirs = _megatron(sizes, blend=(list(prefixes), None if weights is None else list(weights)), split=SPLIT)
    ours = build_datasets(DataSources(blend=Blend(tuple(prefixes), weights)), SPLIT, seq_length=SEQ,
                          seed=SEED, sizes=sizes)
    for split in (0, 1):
        assert len(theirs[split]) == len(ours[split])
        assert np.array_equal(theirs[split].dataset_index, ours[split].dataset_index)
        assert np.array_equal(theirs[split].dataset_sample_index, ours[split].dataset_sample_index)
        for t, o in zip(theirs[split].datasets, ours[split].datasets, strict=True):
            _assert_same_gpt(t, o)
        assert _same_samples(theirs[split], ours[split]) == min(200, len(ours[split]))


def test_per_split_paths_equal_megatron_core(corpora: list[str]) -> None:
    a, b, c = corpora
    per_split = (Blend((a, b), (1.0, 2.0)), Blend((c,)), None)
    sizes = [150, 30, 0]
    theirs = _megatron(sizes, blend_per_split=[([a, b], [1.0, 2.0]), ([c], None), None])
    ours = build_datasets(DataSources(per_split=per_split), SPLIT, seq_length=SEQ, seed=SEED, sizes=sizes)
    assert np.array_equal(theirs[0].dataset_index, ours[0].dataset_index)
    assert _same_samples(theirs[0], ours[0]) == 150
    _assert_same_gpt(theirs[1], ours[1])
    assert ours[2] is None


def test_blend_parsing() -> None:
    assert parse_blend(["0.3 A 0.7 B"]) == Blend(("A", "B"), (0.3, 0.7))
    assert parse_blend(["0.3", "A", "0.7", "B"]) == Blend(("A", "B"), (0.3, 0.7))
    assert parse_blend(["A", "B"]) == Blend(("A", "B"))
    with pytest.raises(DataError, match="looks like a weight"):
        parse_blend(["0.3 A 0.7"])


def test_blend_cache_reused(corpora: list[str], tmp_path: Path) -> None:
    src = DataSources(blend=Blend(tuple(corpora[:2]), (0.5, 0.5)))
    build = lambda: build_datasets(src, SPLIT, seq_length=SEQ, seed=SEED, sizes=[90, 0, 0],  # noqa: E731
                                   cache_dir=str(tmp_path))[0]
    first = build()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any("_blend_" in f for f in files)
    again = build()
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    assert np.array_equal(first.dataset_index, again.dataset_index)
