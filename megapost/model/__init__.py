"""The Llama model: plain torch modules, no parallelism, DeepSpeed or metrics."""

from megapost.model.block import TransformerBlock
from megapost.model.config import ModelConfig
from megapost.model.llama import Embedding, Head, LlamaModel, build_block
from megapost.model.loss import lm_loss
from megapost.model.probe import Probe, set_listener

__all__ = ["Embedding", "Head", "LlamaModel", "ModelConfig", "Probe", "TransformerBlock", "build_block",
           "lm_loss", "set_listener"]
