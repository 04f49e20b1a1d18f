"""The trigger experiment's analysis (issue 40 item 5): when a run's outcome is decided, what at that
time separates the replicas that collapse, and which intervention from there rescues them. Torch-free
(numpy); the replicas are run by ``tools/trigger_experiment.py``.

A *replica* is one continuation of a base run from a rollback snapshot at step S: the same weights,
optimizer state, lr schedule and RNG as the base at S; it differs from the base and from the other
replicas of S only in its data window after S (replica r trains on the samples from the base's position
+ r * offset on; replica 0 is the base run itself). Its outcome is ``events.from_series`` over the base's
series up to S followed by its own. One record per replica (``replicas.jsonl``, schema below); a
collapse is the paper's event (``delayed``). The analysis reads only the records:

* ``decision_table``: P(collapse | snapshot step) over the control replicas (no intervention), with a
  Wilson 95 % interval; ``decided_from``: the earliest snapshot step from which every later snapshot's
  P(collapse) is >= ``level`` (decided to collapse) or <= 1 - ``level``.
* ``separation``: per feature (measured on each replica ``lag`` steps after its snapshot), the AUC of
  collapsed vs survived over pairs from the same snapshot (so the snapshot step cannot separate), with a
  stratified bootstrap interval; and ``logistic``: the outcome on the standardised features (pooled,
  Newton's method with a small ridge so that separation gives large finite coefficients), Wald 95 %.
* ``rescues``: per (snapshot, intervention), paired with the control of the same replica: rescued =
  the control collapsed and the intervention survived, harmed = the reverse, Wilson intervals, and the
  exact two-sided sign test over the discordant pairs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megapost.study.counts import Z95, poisson_interval, sign_test, wilson
from megapost.study.events import DEFAULT as CRITERION

SCHEMA, VERSION = "megapost.trigger", 1
CONTROL = "none"
SUSTAIN = CRITERION.sustain  # a collapse is confirmed K steps after its start
# the regression's features: (key in a record's "features", transform, label)
FEATURES: tuple[tuple[str, str, str], ...] = (
    ("resid_deep", "log", "log residual norm, deepest layer (FFN sum)"),
    ("attn_s_top", "log", "log attention through W_V W_O, top layers (sum_h ||W_V^h W_O^h||_F^2 / d)"),
    ("one_minus_tsim", "log", "log (1 - t_sim(X^H))"),
    ("adam_v_first", "log", "log Adam exp_avg_sq, layer 1 (the layer whose gradient vanishes)"),
)
Record = Mapping[str, Any]


def collapsed(record: Record) -> bool:
    return record["event"] == "delayed"


def final_gap(losses: Sequence[float | None], freq_loss: float) -> float | None:
    """The mean of the last ``events`` window (5) of measured losses minus L (None without a loss)."""
    tail = [v for v in losses[-CRITERION.window:] if v is not None and math.isfinite(v)]
    return sum(tail) / len(tail) - freq_loss if tail else None


def series_name(record: Record) -> str:
    """The name of a record's series file, ``series/<name>.csv``: ``base`` for the base run (replica 0
    without intervention), else ``S<snapshot>_r<replica>_<intervention>``."""
    if int(record["replica"]) == 0 and record["intervention"] == CONTROL:
        return "base"
    return f"S{record['snapshot']}_r{record['replica']}_{record['intervention']}"


def healthy(record: Record) -> bool:
    """Not collapsed and learning at the end: the trailing loss (``final_gap``, the mean of the last
    ``events`` window of measured losses, minus L) at least ``learned_gap`` (0.3 nats) below L."""
    gap = record.get("final_gap")
    return not collapsed(record) and gap is not None and gap <= -CRITERION.learned_gap


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The replicas of ``replicas.jsonl`` (one JSON object a line; a line of another schema is an
    error naming the file and line)."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("schema") != SCHEMA or rec.get("version") != VERSION:
            raise ValueError(f"{path}:{i}: not a {SCHEMA} version {VERSION} record")
        out.append(rec)
    return out


KEY_FIELDS = ("event", "event_step", "last_step", "final_loss")


def merge(parts: Sequence[Sequence[Record]]) -> tuple[list[Record], list[str]]:
    """The records of several folders of one setting, one per (snapshot, replica, intervention): a job
    run twice (the base run of each folder) must agree on its outcome; a disagreement is reported and
    the first record kept."""
    seen: dict[tuple[int, int, str], Record] = {}
    conflicts = []
    for part in parts:
        for r in part:
            key = (int(r["snapshot"]), int(r["replica"]), str(r["intervention"]))
            if key not in seen:
                seen[key] = r
            elif any(seen[key].get(f) != r.get(f) for f in KEY_FIELDS):
                diff = ", ".join(f"{f} {seen[key].get(f)} vs {r.get(f)}" for f in KEY_FIELDS)
                conflicts.append(f"snapshot {key[0]} replica {key[1]} {key[2]}: two runs disagree ({diff})")
    return list(seen.values()), conflicts


def controls(records: Iterable[Record]) -> list[Record]:
    return [r for r in records if r["intervention"] == CONTROL]


def risk_steps(record: Record, sustain: int = SUSTAIN) -> int:
    """Steps from the snapshot to the event, or to the last step at which a collapse could still be
    confirmed (``events``: the last step minus K)."""
    end = int(record["event_step"]) if collapsed(record) else int(record["last_step"]) - sustain
    return max(0, end - int(record["snapshot"]))


def decision_table(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Per snapshot step (ascending): n control replicas, k collapsed, P, Wilson interval, event steps,
    and the hazard per 100 steps after the snapshot (events / steps at risk, Poisson interval): a later
    snapshot has fewer steps left before the end, so its P(collapse by the end) is lower at one hazard."""
    by_step: dict[int, list[Record]] = {}
    for r in controls(records):
        by_step.setdefault(int(r["snapshot"]), []).append(r)
    rows = []
    for step in sorted(by_step):
        reps = by_step[step]
        k, n = sum(collapsed(r) for r in reps), len(reps)
        lo, hi = wilson(k, n)
        risk = sum(risk_steps(r) for r in reps)
        hlo, hhi = poisson_interval(k)
        h = sum(healthy(r) for r in reps)
        gaps = [float(r["final_gap"]) for r in reps if r.get("final_gap") is not None]
        rows.append({"snapshot": step, "n": n, "collapsed": k, "p": k / n, "lo": lo, "hi": hi,
                     "healthy": h, "healthy_ci": wilson(h, n),
                     "median_final_gap": float(np.median(gaps)) if gaps else math.nan,
                     "p_lost": 1 - h / n,
                     "event_steps": sorted(int(r["event_step"]) for r in reps if collapsed(r)),
                     "risk_steps": risk, "hazard": 100 * k / risk if risk else math.nan,
                     "hazard_lo": 100 * hlo / risk if risk else math.nan,
                     "hazard_hi": 100 * hhi / risk if risk else math.nan})
    return rows


def decided_from(table: Sequence[Mapping[str, Any]], level: float = 0.9,
                 key: str = "p") -> dict[str, Any]:
    """The earliest snapshot step from which every later one has ``row[key]`` (P(collapse by the end);
    ``p_lost``: P(not healthy at the end)) >= ``level`` (decided: yes) or every later one <= 1 - ``level``
    (decided: no); None when the last snapshot is still open."""
    for outcome, test in (("yes", lambda p: p >= level), ("no", lambda p: p <= 1 - level)):
        step = None
        for row in reversed(table):
            if not test(row[key]):
                break
            step = row["snapshot"]
        if step is not None:
            return {"outcome": outcome, "step": step, "level": level, "key": key}
    return {"outcome": None, "step": None, "level": level, "key": key}


def feature_matrix(records: Sequence[Record]) -> np.ndarray:
    """The transformed features (columns in ``FEATURES`` order); a non-positive value under log is nan."""
    cols = []
    for key, transform, _ in FEATURES:
        raw = np.array([float(r["features"].get(key) if r["features"].get(key) is not None else np.nan)
                        for r in records], dtype=float)
        if transform == "log":
            raw = np.where(raw > 0, np.log(np.where(raw > 0, raw, 1.0)), np.nan)
        cols.append(raw)
    return np.column_stack(cols) if cols else np.zeros((len(records), 0))


def stratified_auc(x: np.ndarray, y: np.ndarray, strata: np.ndarray) -> float:
    """P(x of a collapsed replica > x of a surviving one), ties 1/2, over pairs from the same stratum."""
    wins = pairs = 0.0
    for s in np.unique(strata):
        a, b = x[(strata == s) & (y == 1)], x[(strata == s) & (y == 0)]
        if len(a) and len(b):
            diff = a[:, None] - b[None, :]
            wins += float((diff > 0).sum() + 0.5 * (diff == 0).sum())
            pairs += diff.size
    return wins / pairs if pairs else math.nan


def lost(record: Record) -> bool:
    """Not healthy at the end: collapsed, or on the plateau near L."""
    return not healthy(record)


OUTCOMES = {"collapsed": collapsed, "lost": lost}


def separation(records: Sequence[Record], draws: int = 1000, seed: int = 0,
               outcome: Any = collapsed) -> list[dict[str, Any]]:
    """Per feature: the within-snapshot AUC over the control replicas with a 95 % stratified bootstrap
    interval (replicas resampled within each snapshot), and the number of mixed pairs it rests on."""
    recs = controls(records)
    x_all, y = feature_matrix(recs), np.array([int(outcome(r)) for r in recs])
    strata = np.array([int(r["snapshot"]) for r in recs])
    rng = np.random.default_rng(seed)
    out = []
    for j, (key, _, label) in enumerate(FEATURES):
        ok = np.isfinite(x_all[:, j])
        x, yy, ss = x_all[ok, j], y[ok], strata[ok]
        auc = stratified_auc(x, yy, ss)
        boots = []
        groups = [np.flatnonzero(ss == s) for s in np.unique(ss)]
        for _ in range(draws if math.isfinite(auc) else 0):
            idx = np.concatenate([rng.choice(g, size=len(g)) for g in groups])
            boots.append(stratified_auc(x[idx], yy[idx], ss[idx]))
        boots = [b for b in boots if math.isfinite(b)]
        lo, hi = (np.percentile(boots, [2.5, 97.5]).tolist() if boots else (math.nan, math.nan))
        mixed = sum(int(((ss == s) & (yy == 1)).sum() * ((ss == s) & (yy == 0)).sum()) for s in np.unique(ss))
        out.append({"feature": key, "label": label, "auc": auc, "lo": lo, "hi": hi, "pairs": mixed,
                    "n": int(ok.sum())})
    return out


def logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-2, iters: int = 100) -> dict[str, Any]:
    """Logistic regression of ``y`` on the columns of ``x`` (standardised here) plus an intercept, by
    Newton's method with an L2 penalty ``ridge`` on the slopes; Wald 95 % intervals from the penalised
    information. Returns the coefficients per standard deviation of each column."""
    mean, sd = x.mean(axis=0), x.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    design = np.column_stack([np.ones(len(y)), (x - mean) / sd])
    penalty = np.diag([0.0] + [ridge] * x.shape[1])
    beta = np.zeros(design.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-design @ beta))
        grad = design.T @ (y - p) - penalty @ beta
        info = design.T @ (design * (p * (1 - p))[:, None]) + penalty
        step = np.linalg.solve(info, grad)
        beta = beta + step
        if np.max(np.abs(step)) < 1e-10:
            break
    p = 1 / (1 + np.exp(-design @ beta))
    info = design.T @ (design * (p * (1 - p))[:, None]) + penalty
    se = np.sqrt(np.diag(np.linalg.inv(info)))
    loglik = float(np.sum(y * np.log(np.clip(p, 1e-300, 1)) + (1 - y) * np.log(np.clip(1 - p, 1e-300, 1))))
    return {"coef": beta.tolist(), "se": se.tolist(), "lo": (beta - Z95 * se).tolist(),
            "hi": (beta + Z95 * se).tolist(), "loglik": loglik, "n": int(len(y)), "events": int(y.sum()),
            "ridge": ridge}


def regression(records: Sequence[Record], ridge: float = 1e-2,
               outcome: Any = collapsed) -> dict[str, Any] | None:
    """``logistic`` of the control replicas' outcome on every feature (rows with all features finite);
    None when the outcomes do not vary."""
    recs = controls(records)
    x, y = feature_matrix(recs), np.array([float(outcome(r)) for r in recs])
    ok = np.all(np.isfinite(x), axis=1)
    if ok.sum() < 3 or y[ok].min() == y[ok].max():
        return None
    fit = logistic(x[ok], y[ok], ridge)
    fit["terms"] = ["intercept", *(key for key, _, _ in FEATURES)]
    return fit


def rescues(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Per (snapshot, intervention): paired with the control of the same snapshot and replica."""
    recs = list(records)
    control = {(int(r["snapshot"]), int(r["replica"])): r for r in controls(recs)}
    groups: dict[tuple[int, str], list[tuple[Record, Record]]] = {}
    for r in recs:
        key = (int(r["snapshot"]), int(r["replica"]))
        if r["intervention"] != CONTROL and key in control:
            groups.setdefault((key[0], r["intervention"]), []).append((control[key], r))
    rows = []
    for (step, name), pairs in sorted(groups.items()):
        risk = [(c, t) for c, t in pairs if collapsed(c)]
        rescued = sum(not collapsed(t) for _, t in risk)
        harmed = sum(collapsed(t) for c, t in pairs if not collapsed(c))
        k_t, k_c, n = sum(collapsed(t) for _, t in pairs), sum(collapsed(c) for c, _ in pairs), len(pairs)
        to_health = sum(healthy(t) and not healthy(c) for c, t in pairs)
        from_health = sum(healthy(c) and not healthy(t) for c, t in pairs)
        h_t, h_c = sum(healthy(t) for _, t in pairs), sum(healthy(c) for c, _ in pairs)
        rows.append({"snapshot": step, "intervention": name, "pairs": n, "at_risk": len(risk),
                     "rescued": rescued, "rescued_ci": wilson(rescued, len(risk)), "harmed": harmed,
                     "collapsed": k_t, "collapsed_ci": wilson(k_t, n), "control_collapsed": k_c,
                     "control_ci": wilson(k_c, n), "sign_test_p": sign_test(rescued, harmed),
                     "healthy": h_t, "healthy_ci": wilson(h_t, n), "control_healthy": h_c,
                     "to_health": to_health, "from_health": from_health,
                     "health_sign_test_p": sign_test(to_health, from_health)})
    return rows


def _ci(lo: float, hi: float) -> str:
    return "–" if math.isnan(lo) else f"[{lo:.2f}, {hi:.2f}]"


def base_at_snapshots(records: Iterable[Record]) -> list[dict[str, Any]]:
    """The base run's state at each snapshot (``snapshot_features``: the same for every replica of it)."""
    out: dict[int, dict[str, Any]] = {}
    for r in controls(records):
        f = r.get("snapshot_features") or {}
        if f and int(r["snapshot"]) not in out:
            out[int(r["snapshot"])] = {"snapshot": int(r["snapshot"]), **f}
    return [out[k] for k in sorted(out)]


def _g(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def base_table(rows: Sequence[Mapping[str, Any]], freq_loss: float | None) -> list[str]:
    """Markdown lines: the base run at each snapshot."""
    lines = ["| snapshot | loss - L | t_sim(X^H) | grad ratio | resid norm layer 1 / deepest | "
             "attn s layer 1 / top | Adam v layer 1 |", "|---|---|---|---|---|---|---|"]
    for f in rows:
        gap = None if f.get("loss") is None or freq_loss is None else f["loss"] - freq_loss
        resid, amount = f.get("resid") or [None], f.get("attn_s") or [None]
        lines.append(f"| {f['snapshot']} | {_g(gap, '+.2f')} | {_g(f.get('t_sim_head'), '.2f')} | "
                     f"{_g(f.get('grad_ratio'), '.2g')} | {_g(resid[0], '.3g')} / "
                     f"{_g(f.get('resid_deep'), '.3g')} | "
                     f"{_g(amount[0], '.3g')} / {_g(f.get('attn_s_top'), '.3g')} | "
                     f"{_g(f.get('adam_v_first'), '.2g')} |")
    return lines


def summary(records: Sequence[Record]) -> dict[str, Any]:
    table = decision_table(records)
    return {"schema": SCHEMA + ".summary", "version": VERSION, "replicas": len(records),
            "decision": table,
            "decided": {"collapsed": decided_from(table), "lost": decided_from(table, key="p_lost")},
            "separation": {k: separation(records, outcome=f) for k, f in OUTCOMES.items()},
            "regression": {k: regression(records, outcome=f) for k, f in OUTCOMES.items()},
            "rescues": rescues(records), "base": base_at_snapshots(records),
            "freq_loss": next((float(r["freq_loss"]) for r in records if r.get("freq_loss") is not None),
                              None)}


def markdown(summ: Mapping[str, Any]) -> str:
    """The three tables of ``summary`` as markdown."""
    lines = ["| snapshot step | collapsed / replicas | P(collapse) | 95 % | hazard / 100 steps | 95 % | "
             "ends healthy | 95 % | median final gap | event steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summ["decision"]:
        steps = ", ".join(map(str, r["event_steps"])) or "–"
        lines.append(f"| {r['snapshot']} | {r['collapsed']}/{r['n']} | {r['p']:.2f} | "
                     f"{_ci(r['lo'], r['hi'])} | {r['hazard']:.2f} | {_ci(r['hazard_lo'], r['hazard_hi'])} | "
                     f"{r['healthy']}/{r['n']} | {_ci(*r['healthy_ci'])} | {r['median_final_gap']:+.2f} | "
                     f"{steps} |")
    lines += ["", "The base run at each snapshot (every replica of a snapshot starts from this state):", "",
              *base_table(summ["base"], summ["freq_loss"])]
    for name, d in summ["decided"].items():
        bound = f">= {d['level']:g}" if d["outcome"] != "no" else f"<= {1 - d['level']:g}"
        when = f"from snapshot step {d['step']}" if d["step"] is not None else "not by the last snapshot"
        lines += ["", f"Decided ({name}: P {bound} at every later snapshot): {when}"]
    sep = summ["separation"]
    lines += ["", "| feature | AUC, collapsed by the end | 95 % | mixed pairs | AUC, lost (not healthy) | "
              "95 % | mixed pairs |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(sep["collapsed"], sep["lost"], strict=True):
        lines.append(f"| {a['label']} | {a['auc']:.2f} | {_ci(a['lo'], a['hi'])} | {a['pairs']} | "
                     f"{b['auc']:.2f} | {_ci(b['lo'], b['hi'])} | {b['pairs']} |")
    for name, reg in summ["regression"].items():
        if reg is None:
            continue
        lines += ["", f"Logistic regression of {name} (pooled control replicas, n {reg['n']}, "
                  f"{reg['events']} {name}, ridge {reg['ridge']:g}; per SD of the feature):", "",
                  "| term | coef | 95 % (Wald) |", "|---|---|---|"]
        for t, c, lo, hi in zip(reg["terms"], reg["coef"], reg["lo"], reg["hi"], strict=True):
            lines.append(f"| {t} | {c:+.2f} | [{lo:+.2f}, {hi:+.2f}] |")
    lines += ["", "| snapshot | intervention | rescued / collapsing controls | 95 % | harmed | P(collapse) "
              "treated | control | sign test p | ends healthy treated | control | to / from healthy | "
              "sign test p |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summ["rescues"]:
        lines.append(f"| {r['snapshot']} | {r['intervention']} | {r['rescued']}/{r['at_risk']} | "
                     f"{_ci(*r['rescued_ci'])} | {r['harmed']} | {r['collapsed']}/{r['pairs']} "
                     f"{_ci(*r['collapsed_ci'])} | {r['control_collapsed']}/{r['pairs']} | "
                     f"{r['sign_test_p']:.3g} | {r['healthy']}/{r['pairs']} {_ci(*r['healthy_ci'])} | "
                     f"{r['control_healthy']}/{r['pairs']} | {r['to_health']} / {r['from_health']} | "
                     f"{r['health_sign_test_p']:.3g} |")
    return "\n".join(lines) + "\n"
