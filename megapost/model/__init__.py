"""The Llama model: plain torch modules, no parallelism, DeepSpeed or metrics."""

from .block import TransformerBlock
from .config import ModelConfig
from .llama import Embedding, Head, LlamaModel, build_block
from .loss import lm_loss
from .probe import Probe, set_listener

__all__ = ["Embedding", "Head", "LlamaModel", "ModelConfig", "Probe", "TransformerBlock", "build_block",
           "lm_loss", "set_listener"]
