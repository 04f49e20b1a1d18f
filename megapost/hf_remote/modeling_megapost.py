"""A megapost model for ``transformers``: Llama layers (RMSNorm, RoPE rotate-half, causal attention,
SwiGLU, untied head) with megapost's norm placement (``post``: an RMSNorm after every residual add, no
final norm; ``pre``: Llama's) and the optional prefix-averaging term (attention output minus
``prefix_alpha`` x the causal running mean of V). Parameter names are Llama's. No KV cache: each
forward recomputes the whole sequence (``generate()`` is correct, only slower). Self-contained."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megapost import MegapostConfig


class MegapostRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def rope(x, positions, theta):
    """Rotate [b, heads, s, d] by ``positions`` [b, s] (rotate-half convention)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * emb.cos() + rotated.float() * emb.sin()).to(x.dtype)


class MegapostAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, self.heads = config.hidden_size, config.num_attention_heads
        self.head_dim = d // self.heads
        self.groups = config.num_key_value_heads
        self.theta, self.alpha = config.rope_theta, config.prefix_alpha
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.groups * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.groups * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(self, x, positions, mask, keep):
        b, s, _ = x.shape

        def split(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        if self.groups != self.heads:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.alpha:
            w = keep[:, None, :, None].to(torch.float32)  # running mean over the real (unpadded) tokens
            mean = (v.float() * w).cumsum(dim=-2) / w.cumsum(dim=-2).clamp_min(1.0)
            out = out - self.alpha * mean.to(v.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MegapostMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MegapostDecoderLayer(nn.Module):
    """post: x = N1(x + Attn(x)); x = N2(x + FFN(x)).  pre: x = x + Attn(N1(x)); x = x + FFN(N2(x))."""

    def __init__(self, config):
        super().__init__()
        self.post = config.norm_position == "post"
        self.self_attn = MegapostAttention(config)
        self.mlp = MegapostMLP(config)
        self.input_layernorm = MegapostRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MegapostRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, mask, keep):
        if self.post:
            x = self.input_layernorm(x + self.self_attn(x, positions, mask, keep))
            return self.post_attention_layernorm(x + self.mlp(x))
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class MegapostPreTrainedModel(PreTrainedModel):
    config_class = MegapostConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegapostDecoderLayer"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, MegapostRMSNorm):
            module.weight.data.fill_(1.0)


class MegapostModel(MegapostPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MegapostDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = (MegapostRMSNorm(config.hidden_size, config.rms_norm_eps)
                     if config.norm_position == "pre" else None)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b, s = input_ids.shape
        keep = (torch.ones(b, s, dtype=torch.bool, device=input_ids.device) if attention_mask is None
                else attention_mask.bool())
        if position_ids is None:
            position_ids = (keep.long().cumsum(-1) - 1).clamp_min(0)
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
        mask = causal[None, None] & keep[:, None, None, :]
        mask = mask | torch.eye(s, dtype=torch.bool, device=input_ids.device)  # padded rows see themselves
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids, mask, keep)
        return self.norm(x) if self.norm is not None else x


class MegapostForCausalLM(MegapostPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = MegapostModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # no cache: the whole sequence

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids, attention_mask, position_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
