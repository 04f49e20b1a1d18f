"""The Engine protocol (megapost.engine) and its DeepSpeed implementation, on a real DeepSpeed engine built
through megapost's build path in this process (world of one, fp32 ZeRO-0, two micro-batches a step):
the loss and the owned gradient against plain torch on a copy of the model, the step applied or skipped,
the state fragments written and read back, the in-memory state restored."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from launch_utils import tiny_model_flags

from megapost.ds_adapter.deepspeed_engine import DeepSpeedEngine
from megapost.engine import MASTER, Engine


def test_deepspeed_engine_has_every_member_of_the_protocol_with_its_signature() -> None:
    members = [n for n in dir(Engine) if not n.startswith("_")]
    assert {"forward_backward", "step", "owned_grad", "owned_state", "write_state", "destroy"} <= set(members)
    for name in members:
        theirs, ours = getattr(Engine, name), getattr(DeepSpeedEngine, name)
        if callable(theirs):
            ours_, theirs_ = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
            assert list(ours_) == list(theirs_), name


@pytest.fixture
def trainer(tiny_data, tmp_path) -> Any:
    from megapost.runtime.distributed import process_group_scope
    from megapost.train.build import build
    from megapost.train.prepare import prepare

    flags = tiny_model_flags(tiny_data, **{"--train-iters": 4, "--lr-warmup-iters": 0,
                                           "--runs-dir": tmp_path / "runs", "--run-name": "e"})
    with process_group_scope():
        built = build(prepare(flags))
        try:
            yield built
        finally:
            built.close()


def _engine(trainer: Any) -> Engine:
    if isinstance(trainer.engine, DeepSpeedEngine):
        return trainer.engine
    return DeepSpeedEngine(trainer.engine, trainer.runner.loss_fn, pipeline=False, tp_rank=0, dp_rank=0,
                           skip_flag=trainer.logger.skips.last)


def _micro_batches(trainer: Any, n: int) -> list[dict[str, torch.Tensor]]:
    trainer.runner.start_data(0)
    return [{k: b[k] for k in ("tokens", "labels", "loss_mask")} for b in
            (next(trainer.runner.batches) for _ in range(n))]


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_a_step_against_plain_torch_then_a_skipped_step_then_a_restore(trainer) -> None:
    engine = _engine(trainer)
    assert isinstance(engine, Engine)
    batches = _micro_batches(trainer, 4)
    reference = copy.deepcopy(engine.module)  # plain torch: the mean of two micro-batch losses
    loss_fn = trainer.runner.loss_fn
    losses = [loss_fn(reference(b["tokens"]), b["labels"], b["loss_mask"]) for b in batches[:2]]
    torch.stack(losses).mean().backward()
    before, saved = _weights(engine.module), copy.deepcopy(engine.state_dict())

    loss = engine.forward_backward(iter(batches[:2]), 2)
    assert float(loss) == pytest.approx(float(torch.stack(losses).mean().detach()), rel=1e-6)
    for p, q in zip(engine.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(engine.owned_grad(p), q.grad, rtol=1e-5, atol=1e-7)
    assert float(engine.step()) == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))

    stepped = _weights(engine.module)
    engine.forward_backward(iter(batches[2:]), 2)
    next(engine.module.parameters()).grad.view(-1)[0] = float("inf")
    assert float(engine.step()) != 0.0  # skipped: nothing moved
    assert all(torch.equal(a, b) for a, b in zip(stepped, engine.module.parameters(), strict=True))

    engine.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))


def test_state_fragments_out_and_in(trainer) -> None:
    engine = _engine(trainer)
    engine.forward_backward(iter(_micro_batches(trainer, 2)), 2)
    engine.step()  # Adam's moments exist
    p = next(engine.module.parameters())
    start, numel, values = engine.owned_state(p, ("exp_avg",))
    assert (start, numel) == (0, p.numel()) and torch.equal(values[MASTER], p.detach().reshape(-1))
    moment = torch.arange(p.numel(), dtype=torch.float32)
    engine.write_state(p, "exp_avg", moment)
    engine.write_state(p, MASTER, moment + 1)
    _, _, again = engine.owned_state(p, ("exp_avg",))
    assert torch.equal(again["exp_avg"], moment) and torch.equal(again[MASTER], moment + 1)
    assert torch.equal(p.detach().reshape(-1), moment + 1)


def _optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    state = engine.state_dict()["optimizer"]["state"]
    return [v.clone() for k in sorted(state) for v in state[k].values() if isinstance(v, torch.Tensor)]


def test_the_plugins_rollback_restores_the_real_state(trainer) -> None:
    """PluginContext.snapshot / restore (what the guard uses) over the real trainer: right after a restore
    the weights, Adam's state, the lr and the data position are the snapshot's, and the step after it
    is the same step, bit for bit."""
    services, engine, st = trainer.host.binding, trainer.engine, trainer.state
    batch = trainer.config.engine.batch.global_batch_size

    def step() -> torch.Tensor:
        loss = trainer.train_step(st.iteration + 1)
        st.iteration, st.consumed_samples = st.iteration + 1, st.consumed_samples + batch
        return loss

    step()
    snap = services.snapshot()
    weights, moments, lr = _weights(engine.module), _optimizer_tensors(engine), float(engine.lr())
    first = (step(), _weights(engine.module))
    step()
    services.restore(snap, False)
    assert (st.iteration, st.consumed_samples) == (1, batch) and float(engine.lr()) == lr
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.module.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(moments, _optimizer_tensors(engine), strict=True))
    again = (step(), _weights(engine.module))
    assert torch.equal(first[0], again[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], again[1], strict=True))
