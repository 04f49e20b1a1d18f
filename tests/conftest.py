"""Shared fixtures: a tiny synthetic English corpus, a tokenizer trained on it, and its .bin/.idx.

``tiny_data`` is built once per session through the real path (tokenizer training, then
preprocessing); other test files reuse it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

_SUBJECTS = """the farmer|a young teacher|the old captain|my neighbour|the city council|a small company|the
river guide|our best engineer|the quiet student|a travelling musician|the hospital director|every
morning train|the village baker|a careful scientist|the football team|her younger brother|the local
newspaper|a famous painter|the national museum|the mountain rescue crew""".replace("\n", " ").split("|")
_VERBS = """built|painted|repaired|discovered|described|carried|ordered|visited|measured|forgot|borrowed|
announced|delivered|followed|questioned|celebrated|photographed|explained|finished|protected""".replace(
    "\n", ""
).split("|")
_OBJECTS = """a wooden bridge|the broken window|three yellow boxes|an interesting theory|the winter
harvest|a long letter|seven heavy stones|the evening concert|a secret garden|the northern road|fresh
bread and cheese|the quarterly report|a silver bicycle|the election results|a strange noise|twelve
empty bottles|the history exhibition|a beautiful sunrise|the weather forecast|forty kilometres of
track""".replace("\n", " ").split("|")
_TAILS = """yesterday|before dinner|after the storm|in the market square|without any help|during the
holidays|near the harbour|for the first time|with great care|at midnight|despite the rain|on Tuesday
afternoon|in 1987|by the old church|while everyone watched|under a grey sky""".replace("\n", " ").split("|")


def synthetic_documents(num_docs: int, seed: int = 0) -> list[str]:
    """Deterministic English-looking documents of a few sentences each."""
    rng = np.random.RandomState(seed)
    pick = lambda options: options[rng.randint(len(options))].strip()
    docs = []
    for _ in range(num_docs):
        sentences = [
            f"{pick(_SUBJECTS).capitalize()} {pick(_VERBS)} {pick(_OBJECTS)} {pick(_TAILS)}."
            for _ in range(rng.randint(2, 7))
        ]
        docs.append(" ".join(sentences))
    return docs


def write_jsonl(path: Path, texts: list[str], **extra: str) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text, **extra}) + "\n")
    return path


@dataclass(frozen=True)
class TinyData:
    """Paths and facts of the tiny corpus (also readable as ``tiny_data["prefix"]``)."""

    prefix: str
    tokenizer_model: str
    vocab_size: int
    num_documents: int
    num_tokens: int
    texts: tuple[str, ...] = field(repr=False)
    shards: tuple[str, ...] = field(repr=False)

    def __getitem__(self, key: str) -> object:
        return getattr(self, key)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that runs the trainer in this process (``megapost.pretrain.main``) must not leave its
    process group (or the world-of-one variables) to the tests after it: megapost.pretrain ends them."""
    import os

    import torch.distributed as dist

    before, rank = dist.is_initialized(), os.environ.get("RANK")
    yield
    leaked = not before and dist.is_initialized()
    if leaked:
        dist.destroy_process_group()
    assert not leaked, "this test left a torch.distributed process group initialised"
    assert os.environ.get("RANK") == rank, "this test left RANK set in the environment"


LAUNCHES = ("megapost.pretrain", "fault_pretrain", "deepspeed", "torchrun", "srun", "examples/", "tools/",
            "benchmarks/")


@pytest.fixture(autouse=True)
def unit_tests_start_no_runs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier stays fast (docs/testing.md): a test that starts a trainer run, a launcher, a tool
    or a set of ranks (tests/dist_utils.run_ranks) must be marked ``integration`` (or ``slow``)."""
    if request.node.get_closest_marker("integration") or request.node.get_closest_marker("slow"):
        return
    import multiprocessing.process
    import subprocess

    def refuse(what: str) -> None:
        pytest.fail(f"{request.node.nodeid} starts {what}: mark it @pytest.mark.integration "
                    f"(docs/testing.md)", pytrace=False)

    popen_init, start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def checked_popen(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> None:
        cmd = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if any(word in cmd for word in LAUNCHES):
            refuse(f"`{cmd[:100]}`")
        popen_init(self, args, *rest, **kw)

    def checked_start(self: multiprocessing.process.BaseProcess) -> None:
        if getattr(getattr(self, "_target", None), "__name__", "") == "_rank_main":
            refuse("ranks (run_ranks)")
        start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", checked_start)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    from megapost.data import IndexedDataset, SentencePieceTokenizer, preprocess, train_tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    texts = synthetic_documents(240)
    shards = [write_jsonl(root / f"tiny.{k}.jsonl", texts[k * 120 : (k + 1) * 120]) for k in range(2)]
    model = train_tokenizer([str(p) for p in shards], root / "tokenizer", vocab_size=512, byte_fallback=False)
    stats = preprocess(
        [str(root / "tiny.*.jsonl")],
        output_prefix=root / "tiny",
        tokenizer_model=model,
        append_eod=True,
        progress=False,
        log=None,
    )
    prefix = stats.outputs["text"]
    dataset = IndexedDataset(prefix)
    return TinyData(
        prefix=prefix,
        tokenizer_model=str(model),
        vocab_size=SentencePieceTokenizer(model).vocab_size,
        num_documents=len(dataset),
        num_tokens=dataset.num_tokens,
        texts=tuple(texts),
        shards=tuple(str(p) for p in shards),
    )


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter for this test only (``TRITON_INTERPRET=1``, read when a kernel is defined), with
    torch's fp32 -> bf16 cast where the interpreter truncates, and numpy's sum for the kernels' ``_add``
    reductions (tests/test_kernels_triton.py's docstring)."""
    from triton.language import bfloat16, float32
    from triton.runtime import interpreter as interp

    convert = interp._convert_float

    def rtne(data: np.ndarray, src: object, dst: object, rounding: object) -> np.ndarray:
        if src == float32 and dst == bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return convert(data, src, dst, rounding)

    monkeypatch.setattr(interp, "_convert_float", rtne)
    from megapost.kernels import triton_kernels

    reduce = interp.ReduceOps.apply_impl

    def fast_sum(self: interp.ReduceOps, input: list) -> object:  # numpy's sum, as for tl.sum
        return self.sum(input[0]) if self.combine_fn is triton_kernels._add else reduce(self, input)

    monkeypatch.setattr(interp.ReduceOps, "apply_impl", fast_sum)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
