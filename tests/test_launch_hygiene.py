"""Launch hygiene (issue 28 item 3): a run without --save says once where its checkpoints go and how
large they are; a completed async write says its size and seconds; a resumed run with nothing left to
train says so in one line and saves nothing."""

from __future__ import annotations

import re

import pytest
import torch
from launch_utils import tiny_model_flags


def _size(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from megapost.pretrain import run

    run(argv)
    return capsys.readouterr().out


def test_untyped_save_note_async_line_and_nothing_to_train(tiny_data, tmp_path, capsys) -> None:
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 2, "--log-interval": 2, "--async-save": True,
                                           "--runs-dir": tmp_path / "runs", "--run-name": "r"})
    first = _run(flags, capsys)
    tag = tmp_path / "runs" / "r" / "checkpoints" / "iter_0000002"
    note = re.findall(r"no --save typed: checkpoints go to the run directory, \S+ \(~([\d.]+) GB each", first)
    assert len(note) == 1, first[-3000:]
    assert float(note[0]) * 2**30 == pytest.approx(_size(tag), rel=0.05)  # the estimate vs the files
    done = re.findall(r"async save complete: (\S+) \(([\d.]+) GB in ([\d.]+) s\)", first)
    assert len(done) == 1 and done[0][0].endswith("iter_0000002"), first[-3000:]
    assert float(done[0][1]) == pytest.approx(_size(tag) / 2**30, rel=0.01)
    again = _run(flags, capsys)  # the same command: resumes the finished run
    said = [line for line in again.splitlines() if "nothing to train" in line]
    assert said == [" nothing to train: the run is at iteration 2 of --train-iters 2; raise --train-iters "
                    "(or --train-samples) to go on"], again[-3000:]
    assert "saving checkpoint" not in again and "async save complete" not in again


@pytest.mark.parametrize("load, ranks, cores, expected", [
    (0.0, 1, 8, 8), (0.0, 2, 8, 4), (6.0, 2, 8, 2),  # 8 cores, 6 kept busy beside our 2 ranks' -> 4 free
    (3.0, 1, 2, 1), (40.0, 1, 2, 1), (1.0, 4, 2, 1),  # under load, or more ranks than cores: 1
])
def test_threads_per_rank_fit_the_free_cores(monkeypatch, load, ranks, cores, expected) -> None:
    from megapost.runtime import cpu

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setattr(cpu, "load_average", lambda: load)
    monkeypatch.setattr(cpu, "usable_cores", lambda: cores)
    before = torch.get_num_threads()
    try:
        text = cpu.set_threads()
        assert torch.get_num_threads() == expected and text.startswith(f"threads {expected}/rank"), text
    finally:
        torch.set_num_threads(before)
