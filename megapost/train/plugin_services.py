"""The services of ``megapost.plugin_api.PluginContext``: megapost's model, collectives, corpus and
collapse law behind the protocols a plugin sees, and the contexts the build gives its plugins (the
trainer-bound part: megapost.train.plugin_binding)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megapost.config.resolved import Config
from megapost.data.gpt_dataset import GPTDataset, split_document_ranges
from megapost.data.indexed_dataset import IndexedDataset
from megapost.model import LlamaModel, ModelConfig, set_listener
from megapost.model.init import matrix_std
from megapost.model.rope import apply_rope_tables
from megapost.parallel import collectives
from megapost.plugin_api import ForwardProbes, PluginContext, RunInfo, Services
from megapost.study.boundary_law import load_law, run_factors


class Collectives:
    """``plugin_api.Collectives`` over megapost.parallel.collectives."""

    def sum(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        return collectives.all_reduce(x, group)

    def max(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        return collectives.all_reduce(x, group, dist.ReduceOp.MAX)

    def gather(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        return collectives.all_gather(x, 0, group)


@dataclass(frozen=True)
class Corpus:
    """``plugin_api.DatasetReader`` of an indexed dataset's train split (megapost.data)."""

    prefix: str | None
    split: str = "969,30,1"
    cache_dir: str | None = None

    def train_tokens(self) -> np.ndarray:
        if self.prefix is None:
            raise RuntimeError("DatasetReader.train_tokens: this run has no indexed dataset")
        indexed = IndexedDataset(self.prefix)
        start, end = split_document_ranges(len(indexed), self.split)[0]
        if end <= start:
            return indexed.tokens[:0]
        item = indexed.dtype.itemsize
        lo = int(indexed.sequence_pointers[start]) // item
        hi = int(indexed.sequence_pointers[end - 1]) // item + int(indexed.sequence_lengths[end - 1])
        return indexed.tokens[lo:hi]


class Model:
    """``plugin_api.ModelView`` of megapost's Llama model of ``cfg``."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    def listen(self, module: nn.Module, listener: Any) -> int:
        return set_listener(module, listener)

    def blocks(self, module: nn.Module) -> Iterator[tuple[int, nn.Module]]:
        for m in module.modules():
            if isinstance(getattr(m, "layer_number", None), int) and hasattr(m, "probe_attn"):
                yield m.layer_number, m

    def ffn_normalises_sum(self, layer: int) -> bool:
        return self.cfg.rules(layer)[1].post_norm

    def forward_probes(self, module: nn.Module, tokens: torch.Tensor) -> ForwardProbes:
        attention: list[torch.Tensor] = []
        head: dict[str, torch.Tensor] = {}

        def attn_hook(mod: Any, inputs: tuple, _out: Any) -> None:
            x = inputs[0]
            b, s, _ = x.shape
            q = mod.wq(x).view(b, s, -1, mod.head_dim).transpose(1, 2)
            k = mod.wk(x).view(b, s, -1, mod.head_dim).transpose(1, 2)
            if mod.q_norm is not None:
                q, k = mod.q_norm(q), mod.k_norm(k)
            cos, signed_sin = mod._rope_tables(s, x.device, q.dtype)  # the attention's own cached tables
            q, k = apply_rope_tables(q, cos, signed_sin), apply_rope_tables(k, cos, signed_sin)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(mod.head_dim)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            attention.append(scores.masked_fill(causal, -math.inf).float().softmax(-1))

        def lm_head_hook(mod: Any, inputs: tuple, out: torch.Tensor) -> None:
            head.update(head_input=inputs[0], logits=out, weight=mod.weight.detach())

        hooks = [layer.attention.register_forward_hook(attn_hook) for layer in module.layers]
        hooks.append(module.head.lm_head.register_forward_hook(lm_head_hook))
        try:
            with torch.no_grad():
                module(tokens)
        finally:
            for h in hooks:
                h.remove()
        return ForwardProbes(attention, head["head_input"], head["logits"], head["weight"])


class InitModels:
    """``plugin_api.InitModels`` of megapost's Llama model and GPT dataset."""

    @torch.no_grad()
    def untrained_forward(self, cfg: ModelConfig, tokens: torch.Tensor, dtype: torch.dtype,
                          listener: Any) -> None:
        model = LlamaModel(cfg).to(dtype).eval()
        set_listener(model, listener)
        for seq in tokens:
            x = model.embedding(seq[None])
            for layer in model.layers:
                x = layer(x)

    def init_std(self, cfg: ModelConfig, role: str) -> float:
        return matrix_std(cfg, role)

    def sequences(self, data_path: str, seq_length: int, count: int, seed: int = 1234) -> torch.Tensor:
        indexed = IndexedDataset(data_path)
        ds = GPTDataset(indexed, np.arange(len(indexed)), count, seq_length, seed, name="stage1")
        return torch.from_numpy(np.stack([ds[i]["tokens"][:seq_length] for i in range(count)]))


@dataclass(frozen=True)
class Law:
    """``plugin_api.CollapseLaw``: megapost.study.boundary_law for a run of these factors."""

    factors: dict[str, float]

    def load(self, path: str | None, flag: str) -> tuple[Any, str]:
        return load_law(path, flag)

    def run_factors(self) -> dict[str, float]:
        return dict(self.factors)


def run_info(config: Config) -> RunInfo:
    m, o = config.model, config.optimizer
    return RunInfo(num_layers=m.num_layers, hidden_size=m.hidden_size, vocab_size=m.vocab_size,
                   norm_position=m.norm_position, seq_length=m.seq_length,
                   train_iters=config.runtime.train_iters,
                   lr=o.lr, lr_warmup_iters=o.lr_warmup_iters, zero_stage=config.engine.zero_stage,
                   bf16=config.engine.bf16,
                   pipeline_model_parallel_size=config.parallel.pipeline_model_parallel_size)


def law_factors(config: Config) -> dict[str, float]:
    """The run's collapse-law factors (megapost.study.boundary_law.run_factors) from its sections."""
    m, o = config.model, config.optimizer
    return run_factors(SimpleNamespace(lr_warmup_iters=o.lr_warmup_iters, seq_length=m.seq_length,
                                       global_batch_size=config.engine.batch.global_batch_size,
                                       train_iters=config.runtime.train_iters, init_variance=m.init_variance),
                       m)


def model_services(model: ModelConfig, data: Corpus | None = None,
                   factors: dict[str, float] | None = None) -> Services:
    """The services for a run of ``model`` (``data``: none by default; ``factors``: the collapse law's,
    none by default), e.g. for a plugin driven outside a built run (tests, tools)."""
    return Services(model=Model(model), collectives=Collectives(), data=data or Corpus(None),
                    law=Law(factors or {}))


def services(config: Config) -> Services:
    """The services of ``config``'s run."""
    data = config.data
    prefixes = getattr(data.sources, "prefixes", None) or [None]
    return model_services(config.model, Corpus(prefixes[0], data.split, data.cache_dir), law_factors(config))


def plugin_contexts(classes: Sequence[type], config: Config, pstate: Any,
                    writer: Any = None) -> list[PluginContext]:
    """One context per plugin class: its own config (``config.plugins``), the run, layout and services."""
    shared, info = services(config), run_info(config)
    return [PluginContext(config=config.plugins.get(getattr(cls, "name", cls.__name__)), run=info,
                          parallel=pstate, services=shared, tensorboard_dir=config.logging.tensorboard_dir,
                          writer=writer) for cls in classes]
