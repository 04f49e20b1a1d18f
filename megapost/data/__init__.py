"""Data pipeline: Megatron-format indexed datasets, GPT samples, resumable samplers, preprocessing."""

from megapost.data.default_corpus import prepare_default_data
from megapost.data.errors import DataError
from megapost.data.gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    parse_split,
    split_document_ranges,
)
from megapost.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megapost.data.preprocess import PreprocessStats, preprocess
from megapost.data.sampler import (
    DataIterator,
    MegatronPretrainingSampler,
    build_data_iterator,
    collate_tokens,
)
from megapost.data.tokenizer import SentencePieceTokenizer
from megapost.data.tokenizer_training import train_tokenizer

__all__ = [
    "DataError",
    "DataIterator",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "PreprocessStats",
    "SentencePieceTokenizer",
    "best_dtype",
    "build_data_iterator",
    "build_train_valid_test_datasets",
    "collate_tokens",
    "parse_split",
    "prepare_default_data",
    "preprocess",
    "split_document_ranges",
    "train_tokenizer",
]
