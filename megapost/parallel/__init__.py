"""Tensor, sequence, pipeline and data parallelism for the Llama model on DeepSpeed.

Call order on every rank::

    deepspeed.init_distributed(dist_backend="nccl")           # or "gloo" on CPU
    pstate = initialize_parallel(tp, pp, sequence_parallel)
    cfg = ModelConfig(vocab_size=padded_vocab_size(vocab, divisible_by), ...)
    validate_layout(cfg, tp, pp, sequence_parallel, seq_length, world_size)   # build_model does it too
    model, loss_fn = build_model(cfg, pstate, checkpoint_activations, checkpoint_num_layers)
    ds_config |= deepspeed_config_overrides(pstate); assert not deepspeed_config_errors(pstate, ds_config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                      mpu=make_mpu(pstate) if pstate.pp_size == 1 else None)
"""

from megapost.parallel.build import ParallelLlamaModel, build_model, make_loss_fn
from megapost.parallel.ds_layout_config import deepspeed_config_errors, deepspeed_config_overrides
from megapost.parallel.gather import full_state_dict
from megapost.parallel.layout import layout_errors, padded_vocab_size, validate_layout
from megapost.parallel.mpu import MPU, make_mpu
from megapost.parallel.state import ParallelState
from megapost.parallel.topology import initialize_parallel

__all__ = [
    "MPU", "ParallelLlamaModel", "ParallelState", "build_model", "deepspeed_config_errors",
    "deepspeed_config_overrides", "full_state_dict", "initialize_parallel",
    "layout_errors", "make_loss_fn", "make_mpu", "padded_vocab_size", "validate_layout",
]
