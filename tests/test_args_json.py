"""``args.json``: the typed config's sections (format 2), written by the build and read back by a resume
(``launches``) and by the analysis (the placement label); a run's args.json from before the sections
(every flag by name, flat) is still read."""

from __future__ import annotations

import json

from collapse_metrics.analysis.runs import _run_args

from megapost.config import launches
from megapost.config.resolved import resolve
from megapost.train.prepare import prepare

OLD_FORMAT = {  # the shape of a run's args.json before the sections (trimmed): flags by name, flat
    "num_layers": 2, "hidden_size": 64, "norm_position": "sandwich", "qk_norm": True, "lr": 0.003,
    "zero_stage": 0, "collapse_interval": 5,
    "launches": [{"time": "2026-11-30 10:00:00", "argv": ["--num-layers", "2"],
                  "data": {"data_path": ["/data/x"]}, "schedule": {"lr": 0.003, "train_iters": 8}}],
    "resolved": {"model": {"num_layers": 2}},
}


def test_an_old_args_json_is_still_read(tmp_path) -> None:
    (tmp_path / "args.json").write_text(json.dumps(OLD_FORMAT))
    assert launches.read_launches(str(tmp_path)) == OLD_FORMAT["launches"]
    model = _run_args(tmp_path / "args.json")
    assert model is not None and model["norm_position"] == "sandwich" and model["qk_norm"] is True


def test_args_json_is_the_sections(tiny_data, tmp_path) -> None:
    from launch_utils import tiny_model_flags

    prep = prepare(tiny_model_flags(tiny_data, **{"--train-iters": 6}) + ["--norm-position", "pre"])
    config = resolve(prep.args, prep.model, "cpu", prep.plugin_classes)
    launches.write_record(prep.args, [str(tmp_path)], config.to_json())
    written = json.loads((tmp_path / "args.json").read_text())
    assert written["format"] == 2
    assert written["model"]["norm_position"] == "pre" and written["model"]["hidden_size"] == 64
    assert written["engine"]["batch"]["global_batch_size"] == config.engine.batch.global_batch_size
    assert written["runtime"]["train_iters"] == 6 and "hidden_size" not in written  # no flat copy
    # each field once: no name appears in two sections (the batch nested in the engine's)
    names = [k for section in written.values() if isinstance(section, dict) for k in section]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert [launch["schedule"]["train_iters"] for launch in launches.read_launches(str(tmp_path))] == [6]
    model = _run_args(tmp_path / "args.json")
    assert model is not None and model["norm_position"] == "pre"
