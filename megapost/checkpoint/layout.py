"""What a checkpoint is of and may be loaded into: the model's shape and the parallel layout a tag was
written at (:class:`RunLayout`), checked against this run before any process group forms — another
model refused, another layout loaded from the layout-free state (or refused for a tag that has only
DeepSpeed's layout-specific files)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megapost.checkpoint import safety
from megapost.checkpoint.folder import CheckpointFolder
from megapost.checkpoint.format import check_complete, has_native_files, layout_of, read_meta, read_state
from megapost.config.errors import ConfigError
from megapost.config.resolved import Config
from megapost.model import ModelConfig

SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
              "norm_position", "mix_post_fraction", "qk_norm")
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
               "zero_stage", "bf16", "sequence_parallel")


def model_shape(model: ModelConfig) -> dict[str, Any]:
    """The model's shape as a tag's meta records it (``padded_vocab_size``: the model's vocabulary)."""
    shape = {k: getattr(model, k) for k in SHAPE_KEYS if k != "padded_vocab_size"}
    shape["padded_vocab_size"] = model.vocab_size
    shape = {k: shape[k] for k in SHAPE_KEYS}
    if shape["norm_position"] != "mix":
        shape["mix_post_fraction"] = None  # meaningless for the other placements
    return shape


@dataclass(frozen=True)
class RunLayout:
    """What a checkpoint is written at and checked against: the model's shape and the parallel layout
    (``zero_stage``: before resolution as given, after it as the engine runs it)."""

    shape: dict[str, Any]
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    bf16: bool
    sequence_parallel: bool

    @classmethod
    def of(cls, config: Config) -> RunLayout:
        """A resolved run's: ``Config.model`` and ``Config.parallel``, the ZeRO stage the engine runs."""
        par = config.parallel
        return cls(model_shape(config.model), par.tensor_model_parallel_size,
                   par.pipeline_model_parallel_size, par.data_parallel_size, config.engine.zero_stage,
                   config.runtime.bf16, par.sequence_parallel)

    @classmethod
    def before_resolution(cls, model: ModelConfig, given: Mapping[str, Any]) -> RunLayout:
        """At start-up, before any group forms: ``model`` and the layout flags as given (by dest)."""
        return cls(model_shape(model), *(given[k] for k in LAYOUT_KEYS))

    def deepspeed_layout(self) -> dict[str, Any]:
        """What makes DeepSpeed's own files layout-specific (``format.layout_of``)."""
        return layout_of(**{k: getattr(self, k) for k in LAYOUT_KEYS})


def describe_shape(shape: dict[str, Any]) -> str:
    return (f"{shape.get('num_layers')} layers x {shape.get('hidden_size')} hidden, ffn "
            f"{shape.get('ffn_hidden_size')}, {shape.get('num_attention_heads')} heads, vocab "
            f"{shape.get('padded_vocab_size')}, {shape.get('norm_position')}-norm"
            + (f" rho {shape['mix_post_fraction']}" if shape.get("mix_post_fraction") is not None else "")
            + (", qk-norm" if shape.get("qk_norm") else ""))


def _shape_differs(saved: dict[str, Any] | None, ours: dict[str, Any]) -> bool:
    if not saved:
        return False  # a checkpoint from before shapes were recorded
    return any(saved.get(k) is not None and ours.get(k) is not None and saved[k] != ours[k]
               for k in SHAPE_KEYS)


def check_layout(load: str, run: RunLayout, trust: bool = False, step: int | None = None) -> bool:
    """True when the checkpoint at ``load`` loads from megapost's sharded state (always, unless the tag
    also has DeepSpeed's files of this layout: ``--ckpt-format deepspeed``).
    Refuses another model shape, a partial checkpoint, another layout when the tag has no layout-free
    state, and unreadable ``latest``/meta/``.pt`` files (``trust``: --trust-checkpoint) — on every rank
    alike, before any group forms. ``step``: --ckpt-step."""
    tag = CheckpointFolder(load).resolve(step=step).tag
    meta = read_meta(load, tag)
    if meta is not None and _shape_differs(meta.get("model"), run.shape):
        raise ConfigError(f"--load {load} holds a different model ({tag}: "
                          f"{describe_shape(meta['model'])}) than this run ({describe_shape(run.shape)}); "
                          "load a checkpoint of this model, or change the model flags to match it")
    tag_dir = os.path.join(load, tag)
    if check_complete(tag_dir):
        if not has_native_files(tag_dir):
            return True
        header, _ = read_state(tag_dir)
        if header["layout"] != run.deepspeed_layout():
            return True
    if meta is not None:
        _refuse_other_layout(load, run, meta)
    safety.scan_files(tag_dir, trust=trust)
    return False


def _refuse_other_layout(load: str, run: RunLayout, meta: dict[str, Any]) -> None:
    """A checkpoint without layout-free state loads only at the layout that wrote it."""
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        ours = getattr(run, key)
        if meta.get(key, ours) != ours:
            raise ConfigError(
                f"--load {load} was saved with --{key.replace('_', '-')} {meta[key]} but this run uses "
                f"{ours}, and it predates megapost's layout-free checkpoints; resume at the saved layout"
            )
    saved_dp, zero = meta.get("data_parallel_size"), max(meta.get("zero_stage", 0), run.zero_stage)
    if saved_dp is not None and saved_dp != run.data_parallel_size and zero >= 1:
        raise ConfigError(
            f"--load {load} holds ZeRO optimizer shards for {saved_dp} data-parallel ranks but this "
            f"run has {run.data_parallel_size}, and it predates megapost's layout-free checkpoints; resume "
            f"with {saved_dp} x TP x PP ranks"
        )


def check_save_dir(save: str | None, shape: dict[str, Any]) -> None:
    """Refuse to save into ``save`` when its latest checkpoint is of another model than ``shape``."""
    if not save or not CheckpointFolder(save).has_latest():
        return
    try:
        tag = CheckpointFolder(save).resolve(flag="--save").tag
        meta = read_meta(save, tag)
    except ConfigError:
        return  # nothing usable there to protect; the first save replaces 'latest'
    if meta and _shape_differs(meta.get("model"), shape):
        raise ConfigError(f"--save {save} already holds a checkpoint of another model ({tag}: "
                          f"{describe_shape(meta['model'])}; this run: {describe_shape(shape)}); use another "
                          "--save (or --run-name) for this run")
