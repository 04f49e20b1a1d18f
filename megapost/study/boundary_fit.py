"""Maximum-likelihood fit of the collapse law (``megapost.study.boundary_law``) to every probe's seed
outcomes, numpy only.

A probe is one (configuration x, lr) with k of n seeds collapsed. The probit GLM
eta = a log lr - g . z(x), P = Phi(eta) is fitted by Fisher scoring (concave log-likelihood; a 1e-6 ridge
keeps a separable data set finite); then sigma = 1/a and coef = g/a. Forms (warmup term, its w0, a
depth x warmup interaction) are compared by AIC (w0 counts as a parameter); the forms within
``ALT_DELTA_AIC`` are kept as the model-form term of the intervals. Uncertainty: ``tau`` is the residual
scatter of each configuration's own log lr* around the law beyond its own standard error (method of
moments); ``cov`` is the coefficients' covariance over a seed bootstrap (each probe's count redrawn at the
fit: the noise of every vote) plus tau^2 (Z'Z)^-1, the scatter's share (a configuration random effect).
A prediction's variance adds tau^2 itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapost.study.boundary_law import ALT_DELTA_AIC, FACTORS, LOG_FACTORS, WARMUP_FORMS, Branch, Form, Law

W0_GRID = (1.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
RIDGE = 1e-6
NARROW = 1.25
MAX_ALTERNATIVES = 6  # the nearest forms kept for the model-form envelope
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
         -0.82215223, 0.17087277)


def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc with fractional error < 1.2e-7 everywhere (the Chebyshev fit of Numerical Recipes' erfcc)."""
    t = 1.0 / (1.0 + 0.5 * np.abs(x))
    poly = np.zeros_like(t)
    for c in _ERFC[:0:-1]:
        poly = (poly + c) * t
    ans = t * np.exp(-x * x + _ERFC[0] + poly)
    return np.where(x >= 0, ans, 2.0 - ans)


@dataclass(frozen=True)
class Probe:
    """k of n seeds collapsed at ``lr`` in the configuration ``x`` (every factor of FACTORS)."""

    x: tuple[tuple[str, float], ...]
    lr: float
    k: int
    n: int

    @property
    def factors(self) -> dict[str, float]:
        return dict(self.x)


def make_probe(x: dict[str, float], lr: float, k: int, n: int) -> Probe:
    return Probe(tuple((f, float(x[f])) for f in FACTORS), float(lr), int(k), int(n))


def _phi(eta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Phi, 1 - Phi, phi) of eta, accurate in both tails."""
    e = np.clip(eta, -35.0, 35.0)
    return 0.5 * _erfc(-e / math.sqrt(2)), 0.5 * _erfc(e / math.sqrt(2)), np.exp(-0.5 * e * e) / math.sqrt(
        2 * math.pi)


def _loglik(eta: np.ndarray, k: np.ndarray, n: np.ndarray) -> float:
    p, q, _ = _phi(eta)
    return float(np.sum(k * np.log(p) + (n - k) * np.log(q)))


def probit_mle(x: np.ndarray, k: np.ndarray, n: np.ndarray, start: np.ndarray | None = None,
               iters: int = 100) -> tuple[np.ndarray, float]:
    """theta maximising sum k log Phi(x theta) + (n - k) log(1 - Phi(x theta)) (Fisher scoring with
    step halving); returns (theta, log-likelihood)."""
    theta = np.zeros(x.shape[1]) if start is None else start.copy()
    ll = _loglik(x @ theta, k, n) - RIDGE * theta @ theta
    for _ in range(iters):
        p, q, d = _phi(x @ theta)
        score = k * d / p - (n - k) * d / q
        w = n * d * d / (p * q)
        grad = x.T @ score - 2 * RIDGE * theta
        info = (x * w[:, None]).T @ x + 2 * RIDGE * np.eye(x.shape[1])
        step = np.linalg.solve(info, grad)
        for _half in range(30):
            new = theta + step
            new_ll = _loglik(x @ new, k, n) - RIDGE * new @ new
            if new_ll >= ll - 1e-12:
                break
            step = step / 2
        converged = abs(new_ll - ll) < 1e-10
        theta, ll = new, new_ll
        if converged:
            break
    return theta, _loglik(x @ theta, k, n)


@dataclass
class FormFit:
    form: Form
    coef: np.ndarray
    sigma: float
    loglik: float
    theta: np.ndarray

    @property
    def params(self) -> int:
        return len(self.coef) + 1 + (self.form.warmup != "none")  # + sigma, + w0

    @property
    def aic(self) -> float:
        return 2 * self.params - 2 * self.loglik


def _arrays(probes: Sequence[Probe], form: Form) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = np.array([form.design(p.factors) for p in probes])
    lr = np.log([p.lr for p in probes])[:, None]
    return np.hstack([lr, -z]), np.array([p.k for p in probes], float), np.array([p.n for p in probes], float)


def fit_form(probes: Sequence[Probe], form: Form, start: np.ndarray | None = None) -> FormFit:
    x, k, n = _arrays(probes, form)
    if start is None:
        start = np.zeros(x.shape[1])
        start[0], start[1] = 2.0, 2.0 * float(np.mean(x[:, 0]))  # sigma 0.5 around the mean log lr
    theta, ll = probit_mle(x, k, n, start)
    a = theta[0]
    if not a > 0:
        raise ValueError("the fitted boundary has P(collapse) falling with lr: the data hold no boundary")
    return FormFit(form, theta[1:] / a, 1.0 / a, ll, theta)


def varying(probes: Sequence[Probe]) -> list[str]:
    return [f for f in FACTORS if len({p.factors[f] for p in probes}) > 1]


def candidate_forms(probes: Sequence[Probe], ignore: Sequence[str] = ()) -> list[Form]:
    """Every warmup form the data can tell apart: none, and log1p/sat at each w0 of W0_GRID (with a
    depth x warmup interaction when depth varies too)."""
    var = [f for f in varying(probes) if f not in ignore]
    base = tuple(f for f in var if f != "warmup")
    if "warmup" not in var:
        return [Form(base)]
    inter = (False, True) if "depth" in var else (False,)
    return [Form(base)] + [Form((*base, "warmup"), kind, w0, i) for kind in WARMUP_FORMS[1:]
                           for w0 in W0_GRID for i in inter]


def config_key(p: Probe) -> tuple[tuple[str, float], ...]:
    return p.x


def groups(probes: Sequence[Probe]) -> dict[tuple, list[Probe]]:
    out: dict[tuple, list[Probe]] = {}
    for p in probes:
        out.setdefault(config_key(p), []).append(p)
    return out


def config_offsets(probes: Sequence[Probe], fit: FormFit) -> list[tuple[float, float]]:
    """Per configuration: (its own log lr* minus the law's, that offset's variance), by 1-D Newton at the
    fit's sigma; configurations whose probes all agree (no location) are left out."""
    out = []
    for ps in groups(probes).values():
        k = np.array([p.k for p in ps], float)
        n = np.array([p.n for p in ps], float)
        if k.sum() == 0 or k.sum() == n.sum():
            continue
        mu = float(np.dot(fit.coef, fit.form.design(ps[0].factors)))
        u = (np.log([p.lr for p in ps]) - mu) / fit.sigma
        delta = 0.0
        for _ in range(50):
            p_, q_, d = _phi(u - delta / fit.sigma)
            score = -(k * d / p_ - (n - k) * d / q_).sum() / fit.sigma
            info = (n * d * d / (p_ * q_)).sum() / fit.sigma ** 2
            step = float(np.clip(score / info, -0.5, 0.5))
            delta = float(np.clip(delta + step, -5, 5))
            if abs(step) < 1e-9:
                break
        out.append((delta, 1.0 / info))
    return out


def residual_tau(probes: Sequence[Probe], fit: FormFit) -> float:
    offs = config_offsets(probes, fit)
    m, p = len(offs), len(fit.coef)
    if m <= p:
        return 0.0
    excess = sum(d * d for d, _ in offs) / (m - p) - sum(v for _, v in offs) / m
    return math.sqrt(max(excess, 0.0))


def bootstrap_cov(probes: Sequence[Probe], fit: FormFit, draws: int, seed: int) -> np.ndarray:
    """Covariance of coef over ``draws`` refits of a seed bootstrap: every probe's collapsed count redrawn
    as Binomial(n, P(collapse)) at the fit (the seed noise of each vote). Every configuration stays in
    every draw, so a factor measured at one configuration keeps its term (a configuration resample drops
    such a factor in ~1/3 of the draws and its refits then cannot be used)."""
    rng = np.random.default_rng(seed)
    x, _, n = _arrays(probes, fit.form)
    p = np.clip(_phi(x @ fit.theta)[0], 1e-12, 1 - 1e-12)
    coefs = []
    for _ in range(draws):
        k = rng.binomial(n.astype(int), p).astype(float)
        try:
            theta, _ = probit_mle(x, k, n, fit.theta)
        except (ValueError, np.linalg.LinAlgError):
            continue
        if theta[0] > 0:
            coefs.append(theta[1:] / theta[0])
    if len(coefs) < max(10, draws // 2):
        raise ValueError(f"only {len(coefs)} of {draws} seed-bootstrap refits converged: the data hold no "
                         "stable boundary for this form")
    return np.atleast_2d(np.cov(np.array(coefs).T))


def scatter_cov(probes: Sequence[Probe], fit: FormFit, tau: float) -> np.ndarray:
    """The coefficients' covariance from the residual scatter: each configuration's log lr* off the law by
    an independent N(0, tau^2) (a random effect), i.e. tau^2 (Z'Z)^-1 over the configurations' designs."""
    z = np.array([fit.form.design(ps[0].factors) for ps in groups(probes).values()])
    return tau * tau * np.linalg.pinv(z.T @ z)


def select_forms(probes: Sequence[Probe], ignore: Sequence[str] = ()) -> list[FormFit]:
    """Every candidate form's fit, best (lowest AIC) first."""
    fits = []
    for form in candidate_forms(probes, ignore):
        try:
            fits.append(fit_form(probes, form))
        except (ValueError, np.linalg.LinAlgError):
            continue
    return sorted(fits, key=lambda f: f.aic)


def branch(probes: Sequence[Probe], fit: FormFit, best_aic: float, draws: int, seed: int) -> Branch:
    tau = residual_tau(probes, fit)
    cov = bootstrap_cov(probes, fit, draws, seed) + scatter_cov(probes, fit, tau)
    return Branch(fit.form, [float(c) for c in fit.coef], cov.tolist(), tau, fit.aic - best_aic)


def separable(probes: Sequence[Probe]) -> tuple[list[Probe], list[Probe], dict[str, float], list[str]]:
    """(kept, set aside, held, ignored): a factor is identified when two configurations differ in it alone.
    One that varies only together with others over a ratio <= ``NARROW`` gets no term (ignored: within
    the box it moves lr* by less than the noise); otherwise it is held at its most common value (by runs)
    and the configurations at another value are set aside (the tool predicts them as a check)."""
    kept, aside, held, ignored = list(probes), [], {}, []
    while True:
        configs = set(groups(kept))
        bad = None
        for f in (v for v in varying(kept) if v not in ignored):
            i = FACTORS.index(f)
            by_rest: dict[tuple, set[float]] = {}
            for c in configs:
                by_rest.setdefault(c[:i] + c[i + 1:], set()).add(c[i][1])
            if not any(len(v) > 1 for v in by_rest.values()):
                bad = f
                break
        if bad is None:
            return kept, aside, held, ignored
        values = [p.factors[bad] for p in kept]
        if bad in LOG_FACTORS and max(values) <= NARROW * min(values):
            ignored.append(bad)
            continue
        counts: dict[float, int] = {}
        for p in kept:
            counts[p.factors[bad]] = counts.get(p.factors[bad], 0) + p.n
        held[bad] = max(counts, key=lambda v: counts[v])
        aside += [p for p in kept if p.factors[bad] != held[bad]]
        kept = [p for p in kept if p.factors[bad] == held[bad]]


def fit_law(probes: Sequence[Probe], draws: int = 200, seed: int = 0, alternatives: bool = True,
            form: Form | None = None, ignore: Sequence[str] = ()) -> Law:
    """The law over ``probes``: best form by AIC (or ``form``), bootstrap covariance, residual scatter,
    the near-best forms as alternatives, the measured box and the factors held fixed."""
    fits = [fit_form(probes, form)] if form is not None else select_forms(probes, ignore)
    if not fits:
        raise ValueError("no form could be fitted (every probe on one side of the boundary?)")
    best = fits[0]
    alts = [f for f in fits[1:] if f.aic - best.aic <= ALT_DELTA_AIC][:MAX_ALTERNATIVES * alternatives]
    alt_branches = []
    for f in alts:
        try:
            alt_branches.append(branch(probes, f, best.aic, draws, seed))
        except ValueError:
            continue
    box = {f: [min(p.factors[f] for p in probes), max(p.factors[f] for p in probes)] for f in FACTORS}
    fixed = {f: lo for f, (lo, hi) in box.items() if lo == hi}
    return Law(branch(probes, best, best.aic, draws, seed), best.sigma, box, fixed,
               alternatives=alt_branches,
               forms=[{"name": f.form.name, "loglik": f.loglik, "params": f.params, "aic": f.aic,
                       "sigma": f.sigma} for f in fits],
               provenance={"runs": sum(p.n for p in probes), "probes": len(probes),
                           "configs": len(groups(probes)), "ignored": list(ignore)})


def likelihood_ratio(probes: Sequence[Probe], form: Form, factor: str) -> tuple[float, float]:
    """(2 x log-likelihood gain, p-value) of ``factor``'s term(s) in ``form`` against the form without
    it (chi-square with as many dof as terms dropped)."""
    full = fit_form(probes, form)
    if factor == "warmup":
        reduced = Form(tuple(f for f in form.factors if f != "warmup"))
    else:
        reduced = Form(tuple(f for f in form.factors if f != factor), form.warmup, form.w0, form.interaction
                       and factor != "depth")
    small = fit_form(probes, reduced)
    stat = max(0.0, 2 * (full.loglik - small.loglik))
    dof = len(full.coef) - len(small.coef)
    return stat, chi2_sf(stat, dof)


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (integer dof) in closed form."""
    if dof <= 0:
        return 1.0
    if dof % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, dof // 2):
            term *= (x / 2) / i
            total += term
        return math.exp(-x / 2) * total
    s = math.erfc(math.sqrt(x / 2))
    term = math.sqrt(x / 2) * math.exp(-x / 2) / math.sqrt(math.pi) * 2
    for i in range(1, (dof - 1) // 2 + 1):
        s += term
        term *= x / (2 * i + 1)
    return s
