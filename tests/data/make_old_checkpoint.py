"""Make ``tests/data/old_checkpoint/``: a checkpoint written by megapost *before* shard specs were
recorded (commit 7ef976c, main on 2026-12-04), for tests/test_checkpoint_compat.py.

    python tests/data/make_old_checkpoint.py   # at that commit; writes tests/data/old_checkpoint/

A TP=2 ZeRO-1 run of a tiny model (vocab 128, 2 layers x 16 hidden) on the synthetic corpus of
tests/conftest.py, tokenized with the committed ``tokenizer.model``; saved at iteration 2 of 4. The
uninterrupted run's losses (iterations 1-4) are kept in ``losses.json`` so a resume can be compared.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from conftest import synthetic_documents, write_jsonl  # noqa: E402
from launch_utils import pretrain, read_scalars  # noqa: E402

OUT = HERE / "old_checkpoint"
SAVED_AT, TOTAL = 2, 4


def corpus(root: Path, tokenizer: Path | None) -> tuple[str, str]:
    """(data prefix, tokenizer model) of the synthetic corpus under ``root`` (``tokenizer``: reuse it)."""
    from megapost.data import preprocess, train_tokenizer

    shards = [write_jsonl(root / f"tiny.{k}.jsonl", synthetic_documents(240)[k * 120:(k + 1) * 120])
              for k in range(2)]
    if tokenizer is None:
        tokenizer = train_tokenizer([str(p) for p in shards], root / "tokenizer", vocab_size=128,
                                    byte_fallback=False)
        identity_normalizer(tokenizer)
    stats = preprocess([str(root / "tiny.*.jsonl")], output_prefix=root / "tiny", tokenizer_model=tokenizer,
                       append_eod=True, progress=False, log=None)
    return stats.outputs["text"], str(tokenizer)


def identity_normalizer(model: Path) -> None:
    """Drop the NFKC table (240 KB) from ``model``: the corpus is ASCII, so tokens are the same."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model.read_bytes())
    proto.normalizer_spec.name, proto.normalizer_spec.precompiled_charsmap = "identity", b""
    model.write_bytes(proto.SerializeToString())


def flags(prefix: str, tokenizer: str, **extra: object) -> list[str]:
    """The run's flags (the test resumes with the same model and data flags)."""
    base: dict[str, object] = {
        "--data-path": prefix, "--tokenizer-model": tokenizer, "--num-layers": 2, "--hidden-size": 16,
        "--ffn-hidden-size": 32, "--num-attention-heads": 2, "--seq-length": 16, "--micro-batch-size": 2,
        "--global-batch-size": 2, "--lr": 3e-3, "--lr-warmup-iters": 1, "--lr-decay-iters": TOTAL,
        "--log-interval": 1, "--eval-interval": 0, "--seed": 7, "--make-vocab-size-divisible-by": 64,
        "--zero-stage": 1, "--peak-tflops": 1, **extra}
    out: list[str] = []
    for key, value in base.items():
        if value is True:
            out.append(key)
        elif value is not None:
            out += [key, str(value)]
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prefix, tokenizer = corpus(root, None)
        tp = {"--tensor-model-parallel-size": 2}
        pretrain(flags(prefix, tokenizer, **tp, **{"--train-iters": SAVED_AT, "--save": root / "ckpt"}),
                 nprocs=2, timeout=900)
        pretrain(flags(prefix, tokenizer, **tp, **{"--train-iters": TOTAL, "--tensorboard-dir": root / "tb"}),
                 nprocs=2, timeout=900)
        losses = read_scalars(root / "tb", "train/lm_loss")
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(root / "ckpt", OUT, ignore=shutil.ignore_patterns("args.json"))
        shutil.copyfile(tokenizer, OUT / "tokenizer.model")
        (OUT / "losses.json").write_text(json.dumps({str(k): v for k, v in sorted(losses.items())}, indent=1))


if __name__ == "__main__":
    main()
