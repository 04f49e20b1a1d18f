"""The soak's end check (tools/soak.py): a killed-and-resumed run against an uninterrupted one — every
tensor of the final checkpoint (weights, fp32 masters, optimizer state, RNG, plugin state), every
TensorBoard scalar series and the JSONL log, bit for bit, with each (tag, step) written exactly once."""

from __future__ import annotations

import glob
import json
import os
from collections import Counter, defaultdict
from typing import Any

import numpy as np

WALL_CLOCK_PREFIXES = ("throughput/", "throughput-vs-tokens/")  # timings: one value per step, not equal


def checkpoint_tensors(tag_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a tag's layout-free files, keyed ``file:name`` (raw bytes kept exact)."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(tag_dir, "layout_free", "*.safetensors"))):
        for name, array in load_file(path).items():
            out[f"{os.path.basename(path)}:{name}"] = array
    return out


def checkpoint_header(tag_dir: str) -> dict[str, Any]:
    """``state.safetensors``' megapost header minus what a launch (not the training) decides."""
    from safetensors import safe_open

    with safe_open(os.path.join(tag_dir, "layout_free", "state.safetensors"), framework="numpy") as f:
        header = json.loads(f.metadata()["megapost"])
    header.pop("args", None)  # the flags (e.g. --async-save) of the launch that saved it
    return header


def compare_checkpoints(a: str, b: str) -> dict[str, Any]:
    """Bitwise comparison of two tags; ``differ`` lists the tensors (or header keys) that differ."""
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    differ = sorted(set(ta) ^ set(tb))
    for key in sorted(set(ta) & set(tb)):
        x, y = ta[key], tb[key]
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            differ.append(key)
    ha, hb = checkpoint_header(a), checkpoint_header(b)
    differ += [f"header:{k}" for k in sorted(set(ha) | set(hb)) if ha.get(k) != hb.get(k)]
    groups = Counter(k.split(":", 1)[1].split("/")[0].split(".")[0] for k in ta)
    return {"tensors": len(ta), "bytes": int(sum(v.nbytes for v in ta.values())), "groups": dict(groups),
            "differ": differ}


def scalar_events(tb_dir: str) -> dict[str, dict[int, list[float]]]:
    """Every scalar in every event file under ``tb_dir`` (sub-runs prefixed by their folder): tag ->
    step -> the values written (a step written twice shows as two values)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(glob.glob(os.path.join(tb_dir, "**", "*tfevents*"), recursive=True)):
        run = os.path.relpath(os.path.dirname(path), tb_dir)
        for event in EventFileLoader(path).Load():
            if not event.HasField("summary"):
                continue
            for v in event.summary.value:
                if v.HasField("tensor") and v.metadata.plugin_data.plugin_name == "scalars":
                    value = float(tensor_util.make_ndarray(v.tensor).reshape(()))
                elif v.HasField("simple_value"):
                    value = float(np.float32(v.simple_value))
                else:
                    continue
                tag = v.tag if run == "." else f"{run}::{v.tag}"
                out[tag][event.step].append(value)
    return out


def compare_scalars(soak_tb: str, ref_tb: str) -> dict[str, Any]:
    """Per tag: steps duplicated or missing, values that differ (wall-clock tags: steps only)."""
    got, want = scalar_events(soak_tb), scalar_events(ref_tb)
    dup = {t: [s for s, v in steps.items() if len(v) > 1] for t, steps in got.items()}
    dup = {t: s for t, s in dup.items() if s}
    missing, extra, differ, exact = {}, {}, {}, 0
    for tag in sorted(set(got) | set(want)):
        g, w = got.get(tag, {}), want.get(tag, {})
        if set(w) - set(g):
            missing[tag] = sorted(set(w) - set(g))
        if set(g) - set(w):
            extra[tag] = sorted(set(g) - set(w))
        if tag.startswith(WALL_CLOCK_PREFIXES):
            continue
        bad = [s for s in set(g) & set(w) if np.float32(g[s][-1]).tobytes() != np.float32(w[s][-1]).tobytes()]
        if bad:
            differ[tag] = sorted(bad)
        elif tag in got and tag in want:
            exact += 1
    values = sum(len(v) for steps in got.values() for v in steps.values())
    return {"tags": len(set(got) | set(want)), "values": values, "tags_bit_exact": exact,
            "lm_loss_steps": sorted(got.get("train/lm_loss", {})),
            "wall_clock_tags": sorted(t for t in got if t.startswith(WALL_CLOCK_PREFIXES)),
            "duplicated": dup, "missing": missing, "extra": extra, "differ": differ}


def compare_jsonl(a: str, b: str) -> dict[str, Any]:
    """The JSONL logs line by line (the same text: the same floats); records per step counted."""
    with open(a, encoding="utf-8") as f:
        la = f.read().splitlines()
    with open(b, encoding="utf-8") as f:
        lb = f.read().splitlines()
    steps = Counter(json.loads(line)["step"] for line in la)
    ref_steps = Counter(json.loads(line)["step"] for line in lb)
    first = next((i for i, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y), None)
    return {"lines": len(la), "reference_lines": len(lb), "equal": la == lb,
            "first_difference": first, "steps": len(steps),
            "records_per_step_equal": steps == ref_steps}


def bit_exact(report: dict[str, Any]) -> bool:
    c, s, j = report["checkpoint"], report["tensorboard"], report["jsonl"]
    return not c["differ"] and not (s["duplicated"] or s["missing"] or s["extra"] or s["differ"]) \
        and j["equal"]
