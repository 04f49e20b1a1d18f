"""tools/frequency_loss.py on the tiny corpus against a brute-force Counter."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megapost.data import IndexedDataset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import frequency_loss

    return frequency_loss


def entropy(labels: np.ndarray) -> float:
    n = len(labels)
    return -sum(c / n * math.log(c / n) for c in Counter(labels.tolist()).values())


def brute(stream: np.ndarray, seq_len: int) -> tuple[float, float, int]:
    seqs = [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]
    return entropy(stream), float(np.mean([entropy(s) for s in seqs])), len(seqs)


@pytest.mark.parametrize(
    ("extra", "offset", "count"),
    [(["--scope", "tokens"], 0, None),
     (["--scope", "tokens", "--tokens", "1000"], 0, 1000),
     (["--scope", "batch", "--batch-size", "3"], 11, 3 * 50),
     (["--scope", "sequence"], 5, 50)],
)
def test_matches_counter(tool, tiny_data, tmp_path: Path, extra: list[str], offset: int, count: int | None,
                         capsys) -> None:
    stream = np.asarray(IndexedDataset(tiny_data.prefix).tokens, dtype=np.int64)[offset:]
    stream = stream if count is None else stream[:count]
    out = tmp_path / "f.json"
    rc = tool.main(["--data-path", tiny_data.prefix, "--tokenizer-model", tiny_data.tokenizer_model,
                    "--seq-length", "50", "--chunk-tokens", "37", "--offset", str(offset),
                    "--output", str(out), *extra])
    assert rc == 0
    agg, per_seq, n_seq = brute(stream, 50)
    res = json.loads(out.read_text())
    assert res["num_tokens"] == len(stream) and res["num_sequences"] == n_seq
    assert res["aggregated"] == pytest.approx(agg, rel=1e-12)
    assert res["per_sequence"] == pytest.approx(per_seq, rel=1e-12)
    assert res["vocab_size"] == tiny_data.vocab_size and res["tokens_per_s"] > 0
    assert "tokens/s" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temp file left behind


def test_vocab_from_data_and_flag_errors(tool, tiny_data) -> None:
    tokens = IndexedDataset(tiny_data.prefix).tokens
    assert tool.max_token(tokens, 100) == int(np.max(tokens))
    assert tool.main(["--data-path", tiny_data.prefix, "--scope", "sequence", "--seq-length", "20"]) == 0
    with pytest.raises(SystemExit):
        tool.main(["--data-path", tiny_data.prefix, "--scope", "batch", "--tokens", "10"])
