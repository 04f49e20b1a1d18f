"""The collapse law: ONE schema of a fitted Post-Norm collapse boundary, written by
``megapost-law boundary`` (fitting: ``megapost.study.boundary_fit``) and read by the planner's
collapse-risk line and the guard's ``law`` remedy (through ``megapost.plugin_api``).

The law. For a run with factors x (width, depth, warmup, tokens per step, decay_iters = the train iters
after the warmup, sequence length, vocabulary, heads, init) and peak lr ``lr``, one seed collapses with
probability

    P(collapse | lr, x) = Phi((log lr - mu(x)) / sigma),   mu(x) = log lr*(x) = coef . z(x)

where z(x) = (1, log width, log depth, w(warmup), log tokens, ..., [init == std], [log depth * w(warmup)])
has a term only for the factors that vary in the fit's data; w is the warmup form the likelihood chose
(``none``; ``log1p``: log(1 + warmup / w0), a power law in warmup beyond w0; ``sat``: warmup / (warmup +
w0), a gain that saturates). sigma is the seed noise (the width of the boundary in log lr).

The JSON (``version`` 1), every key required unless marked optional:

    schema "megapost.collapse_law", version 1, placement ("post"), criterion (what "collapsed" meant)
    form        {"factors": [...], "warmup": "none"|"log1p"|"sat", "w0": float, "interaction": bool}
    columns     the names of z's entries;  coef: mu's coefficients (same order)
    cov         covariance of coef (a probe-cluster bootstrap: it carries the seeds' noise)
    sigma       probit width in log lr;  tau: residual scatter of a configuration's own log lr* around
                mu (between-configuration lack of fit; added to every prediction's variance)
    level       the intervals' coverage (0.95)
    box         {factor: [min, max]} measured in the data, for every factor
    fixed       {factor: value}: factors constant in the data (no term; predictions hold them there)
    alternatives [ {form, columns, coef, cov, tau, delta_aic} ]: other forms within ``ALT_DELTA_AIC`` of
                the best: a prediction's interval is the envelope over them (the model-form term)
    forms       the comparison: [{"name", "loglik", "params", "aic"}]
    provenance  {"sources": [{"path", "runs"}], "runs", "probes", "configs", "tool", "created"}
    validation  (optional) the leave-one-out table of the tool
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megapost.config.errors import ConfigError
from megapost.utils.atomic import atomic_write_text

SCHEMA, VERSION = "megapost.collapse_law", 1
FACTORS = ("width", "depth", "warmup", "tokens_per_step", "decay_iters", "seq", "vocab", "heads", "init")
LOG_FACTORS = ("width", "depth", "tokens_per_step", "decay_iters", "seq", "vocab", "heads")
INIT_CODE = {"paper": 0.0, "std": 1.0}
WARMUP_FORMS = ("none", "log1p", "sat")
ALT_DELTA_AIC = 2.0
Z95 = 1.959963984540054
UNINFORMATIVE = 10.0  # an interval wider than this ratio: no P(collapse), the term it cannot see past

DEFAULT_LAW = Path("runs") / "collapse_law" / "law.json"
SHIPPED_LAW = Path(__file__).with_name("boundary_law_post.json")  # megapost-law boundary's CPU fit
SHIPPED_LABEL = "megapost/study/boundary_law_post.json, shipped: CPU study, failure-to-start law"
ENV = "MEGAPOST_COLLAPSE_LAW"


def phi_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def warmup_term(warmup: float, kind: str, w0: float) -> float:
    if kind == "log1p":
        return math.log1p(warmup / w0)
    if kind == "sat":
        return warmup / (warmup + w0)
    return 0.0


@dataclass(frozen=True)
class Form:
    """Which factors have a term, and the warmup term's shape."""

    factors: tuple[str, ...]
    warmup: str = "none"
    w0: float = 1.0
    interaction: bool = False  # a log depth x warmup term

    @property
    def name(self) -> str:
        w = "no warmup term" if self.warmup == "none" else f"{self.warmup}(warmup/{self.w0:g})"
        return w + (" + depth x warmup" if self.interaction else "")

    def columns(self) -> list[str]:
        cols = ["const"] + [f"log {f}" if f in LOG_FACTORS else f for f in self.factors if f != "warmup"]
        if self.warmup != "none":
            cols.append(f"warmup:{self.warmup}")
            if self.interaction:
                cols.append("log depth x warmup")
        return cols

    def design(self, x: Mapping[str, float]) -> list[float]:
        """z(x): the entries ``columns`` names."""
        z = [1.0]
        for f in self.factors:
            if f in LOG_FACTORS:
                z.append(math.log(float(x[f])))
            elif f == "init":
                z.append(float(x[f]))
        if self.warmup != "none":
            w = warmup_term(float(x["warmup"]), self.warmup, self.w0)
            z.append(w)
            if self.interaction:
                z.append(math.log(float(x["depth"])) * w)
        return z

    def as_dict(self) -> dict[str, Any]:
        return {"factors": list(self.factors), "warmup": self.warmup, "w0": self.w0,
                "interaction": self.interaction}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Form:
        if d["warmup"] not in WARMUP_FORMS:
            raise ValueError(f"warmup form {d['warmup']!r} not in {WARMUP_FORMS}")
        return cls(tuple(d["factors"]), d["warmup"], float(d["w0"]), bool(d["interaction"]))


@dataclass
class Branch:
    """One form's fit: mu(x) = coef . z(x), its covariance and residual scatter."""

    form: Form
    coef: list[float]
    cov: list[list[float]]
    tau: float
    delta_aic: float = 0.0

    def mu_sd(self, x: Mapping[str, float]) -> tuple[float, float]:
        z = self.form.design(x)
        mu = sum(c * v for c, v in zip(self.coef, z, strict=True))
        var = sum(z[i] * self.cov[i][j] * z[j] for i in range(len(z)) for j in range(len(z)))
        return mu, math.sqrt(max(var, 0.0) + self.tau ** 2)

    def as_dict(self) -> dict[str, Any]:
        return {"form": self.form.as_dict(), "columns": self.form.columns(), "coef": self.coef,
                "cov": self.cov, "tau": self.tau, "delta_aic": self.delta_aic}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Branch:
        form = Form.from_dict(d["form"])
        coef, cov = [float(c) for c in d["coef"]], [[float(v) for v in row] for row in d["cov"]]
        if len(coef) != len(form.columns()) or len(cov) != len(coef) or any(len(r) != len(coef) for r in cov):
            raise ValueError(f"coef/cov do not match the form's {len(form.columns())} columns")
        return cls(form, coef, cov, float(d["tau"]), float(d.get("delta_aic", 0.0)))


@dataclass
class Prediction:
    lr_star: float
    interval: tuple[float, float]
    sd_log: float  # the best form's predictive sd of log lr* (parameters + residual scatter)
    extrapolated: list[str]  # "width 512 > 256", ...
    not_modelled: list[str]  # fixed factors at another value: "vocab 32000 (held at 2048)"

    def p_collapse(self, lr: float, sigma: float) -> float:
        """Predictive P(collapse) of one seed at ``lr``: the seed noise and lr*'s own uncertainty."""
        return phi_cdf((math.log(lr) - math.log(self.lr_star)) / math.hypot(sigma, self.sd_log))

    def lr_at(self, p: float, sigma: float) -> float:
        """The peak lr whose predictive P(collapse) per seed is ``p`` (the inverse of ``p_collapse``)."""
        return self.lr_star * math.exp(_normal_quantile(p) * math.hypot(sigma, self.sd_log))


@dataclass
class Law:
    best: Branch
    sigma: float
    box: dict[str, list[float]]
    fixed: dict[str, float]
    placement: str = "post"
    criterion: str = ""
    level: float = 0.95
    alternatives: list[Branch] = field(default_factory=list)
    forms: list[dict[str, Any]] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] | None = None

    def predict(self, x: Mapping[str, float]) -> Prediction:
        """lr*(x) with its interval (envelope over the forms the data cannot tell apart)."""
        q = Z95 if abs(self.level - 0.95) < 1e-9 else _normal_quantile(0.5 + self.level / 2)
        mu, sd = self.best.mu_sd(x)
        lo, hi = mu - q * sd, mu + q * sd
        for alt in self.alternatives:
            m, s = alt.mu_sd(x)
            lo, hi = min(lo, m - q * s), max(hi, m + q * s)
        ext = [f"{f} {_g(f, x[f])} {'<' if x[f] < a else '>'} {_g(f, a if x[f] < a else b)}"
               for f, (a, b) in self.box.items() if f not in self.fixed and not a <= x[f] <= b]
        nm = [f"{f} {_g(f, x[f])} (held at {_g(f, v)})" for f, v in self.fixed.items() if x[f] != v]
        return Prediction(math.exp(mu), (math.exp(lo), math.exp(hi)), sd, ext, nm)

    def as_dict(self) -> dict[str, Any]:
        d = {"schema": SCHEMA, "version": VERSION, "placement": self.placement, "criterion": self.criterion,
             **{k: v for k, v in self.best.as_dict().items() if k != "delta_aic"}, "sigma": self.sigma,
             "level": self.level, "box": self.box, "fixed": self.fixed,
             "alternatives": [a.as_dict() for a in self.alternatives], "forms": self.forms,
             "provenance": self.provenance}
        return with_validation(d, self.validation)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Law:
        box = read_box(d, SCHEMA, VERSION)
        missing = [f for f in FACTORS if f not in box]
        if missing:
            raise ValueError(f"box lacks {missing}")
        return cls(Branch.from_dict(d), float(d["sigma"]), box, {f: float(v) for f, v in d["fixed"].items()},
                   d["placement"], d.get("criterion", ""), float(d["level"]),
                   [Branch.from_dict(a) for a in d.get("alternatives", [])], list(d.get("forms", [])),
                   dict(d["provenance"]), d.get("validation"))


def with_validation(d: dict[str, Any], validation: dict[str, Any] | None) -> dict[str, Any]:
    if validation is not None:
        d["validation"] = validation
    return d


def read_box(d: Mapping[str, Any], schema: str, version: int) -> dict[str, list[float]]:
    """A law JSON's box, after checking its schema and version (ValueError naming both)."""
    if d.get("schema") != schema or d.get("version") != version:
        raise ValueError(f"schema {d.get('schema')!r} version {d.get('version')!r}, expected "
                         f"{schema!r} version {version}")
    return {f: [float(a), float(b)] for f, (a, b) in d["box"].items()}


def _g(factor: str, v: float) -> str:
    if factor == "init":
        return next((k for k, c in INIT_CODE.items() if c == v), f"{v:g}")
    return f"{v:,.0f}" if v == int(v) else f"{v:.4g}"


def _normal_quantile(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if phi_cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def run_factors(flags: Any, model: Any) -> dict[str, float]:
    """A run's factors from its flags (``--lr-warmup-iters``, ``--global-batch-size``, ``--seq-length``,
    ``--train-iters``, ``--init-variance``; a Namespace or plugin ``Flags``) and its ModelConfig."""
    return {"width": float(model.hidden_size), "depth": float(model.num_layers),
            "warmup": float(flags.lr_warmup_iters or 0),
            "tokens_per_step": float(flags.global_batch_size * flags.seq_length),
            "decay_iters": float(max(1, flags.train_iters - (flags.lr_warmup_iters or 0))),
            "seq": float(flags.seq_length),
            "vocab": float(model.vocab_size), "heads": float(model.num_attention_heads),
            "init": INIT_CODE[flags.init_variance]}


def save_law(path: str | os.PathLike[str], law: Law) -> None:
    atomic_write_text(Path(path), json.dumps(law.as_dict(), indent=1) + "\n")


def load_law(path: str | None, flag: str = "--collapse-law") -> tuple[Law | None, str]:
    """The law (``path``, else $MEGAPOST_COLLAPSE_LAW, else runs/collapse_law/law.json when present, else
    the fit shipped with megapost) and where it came from; (None, reason) when there is none."""
    chosen = path or os.environ.get(ENV) or next(
        (str(f) for f in (DEFAULT_LAW, SHIPPED_LAW) if f.is_file()), None)
    if chosen is None:
        return None, "no collapse-law fit (run megapost-law boundary, or pass --collapse-law FILE)"
    try:
        data = json.loads(Path(chosen).read_text(encoding="utf-8"))
        law = Law.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"{flag} {chosen}: not a megapost-law boundary fit ({type(e).__name__}: {e}); "
                          "refit with megapost-law boundary") from None
    return law, SHIPPED_LABEL if chosen == str(SHIPPED_LAW) else chosen


def exponents(law: Law, level_z: float = Z95) -> list[tuple[str, float, float, float]]:
    """(column, coefficient, lo, hi) of mu: the law's exponents with their intervals."""
    b = law.best
    return [(c, v, v - level_z * math.sqrt(b.cov[i][i]), v + level_z * math.sqrt(b.cov[i][i]))
            for i, (c, v) in enumerate(zip(b.form.columns(), b.coef, strict=True))]


def check_factors(x: Mapping[str, float], where: str) -> None:
    bad = [f for f in FACTORS if f not in x or (f in LOG_FACTORS and not float(x[f]) > 0)]
    if bad:
        raise ConfigError(f"{where}: factors {bad} missing or not positive")


