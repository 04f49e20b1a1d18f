"""What a layout requires of the DeepSpeed config."""

from __future__ import annotations

from typing import Any

from megapost.parallel.state import ParallelState


def deepspeed_config_overrides(pstate: ParallelState) -> dict[str, Any]:
    """Entries to merge into the generated DeepSpeed config for this layout.

    Under --sequence-parallel the activations sent between pipeline stages are different sequence
    shards on each TP rank (already 1/tp of the full size), so DeepSpeed must not partition and
    re-gather them over the TP group, which assumes they are replicated.
    """
    if pstate.pp_size > 1 and pstate.sequence_parallel:
        return {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    return {}


def deepspeed_config_errors(pstate: ParallelState, config: dict[str, Any]) -> list[str]:
    """Reasons ``config`` would train this layout wrongly (one line each; empty when fine).

    With pipeline stages, fp32 and no ZeRO, DeepSpeed clips with ``runtime.utils.clip_grad_norm_``,
    which counts a non-tensor-parallel parameter only where the pipeline grid's model-parallel rank
    (stage x TP position) is 0, i.e. on the first stage: the clipping norm then leaves out every
    later stage. ZeRO stage 1 and the bf16/fp16 optimizers compute the norm correctly.
    ``pipeline.use_reentrant: false`` would swap out the probe-aware checkpoint function.
    """
    errors = []
    stage = config.get("zero_optimization", {}).get("stage", 0)
    half = any(config.get(key, {}).get("enabled", False) for key in ("fp16", "bf16", "bfloat16"))
    if pstate.pp_size > 1 and stage == 0 and not half and config.get("gradient_clipping", 0.0) > 0:
        errors.append("--pipeline-model-parallel-size > 1 in fp32 with gradient clipping needs "
                      "--zero-stage 1 (DeepSpeed's fp32 ZeRO-0 clip norm omits all but the first stage)")
    if pstate.pp_size > 1 and stage >= 2:
        errors.append("--pipeline-model-parallel-size > 1 supports ZeRO stage 0 or 1 only")
    pipeline = config.get("pipeline", {})
    partitioned = pipeline.get("pipe_partitioned", True) or pipeline.get("grad_partitioned", True)
    if pstate.pp_size > 1 and pstate.sequence_parallel and partitioned:
        errors.append("--sequence-parallel with pipeline stages needs pipeline.pipe_partitioned and "
                      "grad_partitioned false (merge deepspeed_config_overrides(pstate))")
    if pstate.pp_size > 1 and pipeline.get("use_reentrant") is False:
        errors.append("pipeline.use_reentrant false makes DeepSpeed replace megapost's activation checkpoint "
                      "function (its probes would report twice); remove it from --deepspeed_config")
    return errors
