"""A run interrupted before its first checkpoint: its args.json (in the TensorBoard directory) still
gives the rerun its data, as the example scripts expect when they skip the default data (issue 52)."""

from __future__ import annotations

import argparse
import json

from megapost.config import launches


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = {key: None for key in launches.DATA_KEYS}
    base.update(load=None, save=str(tmp_path / "ckpt"), tensorboard_dir=str(tmp_path / "tb"), explicit=set())
    base.update({key: None for key in launches.SCHEDULE_KEYS})
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_run_without_a_checkpoint_takes_the_data_it_recorded(tmp_path) -> None:
    (tmp_path / "tb").mkdir()
    data = {"data_path": ["/d/corpus_text_document"], "tokenizer_model": "/d/t.model"}
    recorded = {"launches": [{"data": data, "schedule": {}}]}
    (tmp_path / "tb" / "args.json").write_text(json.dumps(recorded))
    args = _args(tmp_path)
    notes = launches.reconcile_resume(args)
    assert (args.data_path, args.tokenizer_model) == (["/d/corpus_text_document"], "/d/t.model")
    assert notes == ["no checkpoint in this run yet: it starts over from iteration 0 with the data it "
                     "recorded"]
    given = _args(tmp_path, tokenizer_model="/mine.model", explicit={"tokenizer_model"})
    launches.reconcile_resume(given)  # a flag the user typed wins over the record
    assert given.tokenizer_model == "/mine.model" and given.data_path == ["/d/corpus_text_document"]


def test_a_new_run_without_a_record_is_left_alone(tmp_path) -> None:
    args = _args(tmp_path)
    assert launches.reconcile_resume(args) == [] and args.data_path is None
