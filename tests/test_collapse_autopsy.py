"""--collapse-autopsy (collapse_metrics/autopsy.py): the preconditioned-Hessian power iteration against an
exact Hessian, the attention entropy against a direct softmax, and a real run that rewinds on the alarm,
replays the window exactly and writes every quantity per step."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest
import torch
from collapse_metrics.autopsy import Autopsy
from launch_utils import REPO, pretrain, tiny_model_flags


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(7, 4)
        self.out = torch.nn.Linear(4, 7, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(tokens)))


class _OptimizerReads:
    """The two ``PluginContext`` reads the sharpness estimate makes, over a real torch optimizer."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def optimizer_state(self, param: torch.nn.Parameter) -> dict:
        return dict(self.opt.state.get(param, {}))

    def optimizer_hyperparameters(self) -> dict:
        return {k: v for k, v in self.opt.param_groups[0].items() if k != "params"}


def test_preconditioned_sharpness_matches_the_exact_hessian():
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8)
    tokens, labels = torch.randint(0, 7, (2, 5)), torch.randint(0, 7, (2, 5))
    for _ in range(3):  # some second-moment state
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
        opt.step()
    args = argparse.Namespace(collapse_autopsy=1, collapse_autopsy_after=1, collapse_autopsy_on="alarm",
                              collapse_autopsy_power_iters=200, collapse_autopsy_hessian_every=1)
    autopsy = Autopsy(args, None)
    autopsy.probe = {"tokens": tokens, "labels": labels}
    before = [p.detach().clone() for p in model.parameters()]
    lam = autopsy._sharpness(model, _OptimizerReads(opt))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # restored
    # exact: H of the flattened parameters, scaled by P^-1/2 on both sides
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    flat0 = torch.cat([p.detach().flatten() for p in params]).double()

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        chunks, i = [], 0
        for s in shapes:
            n = math.prod(s)
            chunks.append(flat[i:i + n].view(s))
            i += n
        h = torch.tanh(chunks[0][tokens])
        return torch.nn.functional.cross_entropy((h @ chunks[1].T).flatten(0, 1), labels.flatten())

    hess = torch.autograd.functional.hessian(loss_of, flat0)
    beta2, st = 0.999, [opt.state[p] for p in params]
    vhat = torch.cat([(s["exp_avg_sq"] / (1 - beta2 ** float(s["step"]))).flatten() for s in st]).double()
    q = 1 / (vhat.sqrt() + 1e-8).sqrt()
    eig = torch.linalg.eigvalsh(q[:, None] * hess * q[None, :])
    top = eig[eig.abs().argmax()].item()
    assert lam == pytest.approx(top, rel=0.05)


def test_attention_entropy_is_that_of_the_causal_softmax(tiny_data, tmp_path):
    from collapse_metrics.autopsy import attention_entropy

    from megapost.model import LlamaModel, ModelConfig
    from megapost.train.plugin_services import Model

    cfg = ModelConfig(vocab_size=64, num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                      seq_length=6, norm_position="post")
    model = LlamaModel(cfg)
    with torch.no_grad():  # zero queries: uniform causal attention, entropy mean_i log(i)
        model.layers[0].attention.wq.weight.zero_()
    ent, norms = attention_entropy(Model(cfg), model, torch.randint(0, 64, (2, 6)))
    expected = sum(math.log(i) for i in range(1, 7)) / 6
    assert len(ent) == 1 and ent[0] == pytest.approx([expected, expected], abs=1e-5)
    assert norms["logit_norm"] > 0 and norms["head_weight_norm"] > 0 and norms["xh_norm"] > 0


@pytest.mark.integration
def test_autopsy_rewinds_on_the_alarm_and_measures_every_step(tiny_data, tmp_path):
    flags = tiny_model_flags(tiny_data, **{
        "--norm-position": "post", "--num-layers": 12, "--hidden-size": 32, "--ffn-hidden-size": 96,
        "--micro-batch-size": 4, "--global-batch-size": 4, "--train-iters": 12, "--lr": 0.1, "--min-lr": 0.1,
        "--lr-warmup-iters": 0, "--init-variance": "paper", "--seed": 1, "--log-interval": 100,
        "--tensorboard-dir": tmp_path, "--plugins": "collapse_metrics", "--collapse-interval": 2,
        "--collapse-autopsy": 2, "--collapse-autopsy-on": "alarm", "--collapse-autopsy-after": 2,
        "--collapse-autopsy-hessian-every": 2, "--collapse-autopsy-power-iters": 2})
    proc = pretrain(flags)
    log = proc.stdout + proc.stderr
    line = next(x for x in log.splitlines() if x.startswith("[collapse] autopsy: event at step"))
    event = int(line.split("step ")[1].split(";")[0])
    recs = [json.loads(x) for x in (tmp_path / "autopsy.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == list(range(steps[0], event + 3)) and steps[0] <= event - 1, (steps, event)
    for r in recs:
        assert len(r["attn_entropy"]) == 12 and len(r["attn_entropy"][0]) == 4
        assert set(r["update_ratio"]) >= {"layer1", "layer12"} and r["adam_v"]["layer1"][0] > 0
        assert r["logit_norm"] > 0 and r["event_step"] == event
    assert any(math.isfinite(r.get("sharpness_precond", math.nan)) for r in recs)
    main = [json.loads(x) for x in (tmp_path / "collapse_metrics.jsonl").read_text().splitlines()]
    losses: dict[int, list[float]] = {}
    for r in main:
        if "loss" in r:
            losses.setdefault(r["step"], []).append(r["loss"])
    replayed = [s for s, v in losses.items() if len(v) == 2]
    assert replayed and all(losses[s][0] == losses[s][1] for s in replayed)  # the window replays exactly
    assert all(s in losses for s in range(steps[0], event + 3))  # every step measured in the window
    sys.path.insert(0, str(REPO / "tools"))
    import plot_autopsy

    assert plot_autopsy.main(["--run", f"a={tmp_path}", "--out", str(tmp_path / "fig" / "autopsy")]) == 0
    assert (tmp_path / "fig" / "autopsy.png").read_bytes()[:4] == b"\x89PNG"


def test_separation_offsets():
    from collapse_metrics.analysis.autopsy_report import rank_separations, separation

    a = {s: 1.0 if s < 110 else 3.0 for s in range(100, 130)}  # event at 100
    b = {s: 1.0 for s in range(200, 230)}  # event at 200
    assert separation(a, b, 100, 200) == 10
    flicker = {**a, 120: 1.0}  # back together at +20: separates only from +21
    assert separation(flicker, b, 100, 200) == 21 and separation(b, b, 200, 200) is None
    ent = {s: 2.0 - (0.5 if s >= 105 else 0.0) for s in range(100, 130)}
    ranked = rank_separations({"x": a, "attn_entropy/layer1": ent, "lr": a},
                              {"x": b, "attn_entropy/layer1": {s: 2.0 for s in range(200, 230)}, "lr": b},
                              100, 200)
    assert ranked == [("attn_entropy/layer1", 5), ("x", 10)]  # entropies compared on the log scale
