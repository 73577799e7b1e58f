"""Llama 3 (Meta's published configurations) and the pieces the MoE models share with it
(tracer.moe): mixed-precision layers (float32 parameters cast to bfloat16 where used, as
torchtitan's FSDP2 policy or autocast; `bf16_params` in tracer.models.build: bfloat16
parameters with MasterWeightAdamW, Megatron-LM's scheme), RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU. tracer.models.build builds them by name.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# -- Llama 3 -------------------------------------------------------------------------------------
# Meta's published configurations (params.json / config.json of each release)
LLAMA = {
    "llama3-8b": dict(
        dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False
    ),
    "llama3-70b": dict(
        dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256, tied=False
    ),
    "llama3.2-1b": dict(
        dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied=True
    ),
    # Llama 3.1 405B (its 8B and 70B have Llama 3's shapes)
    "llama3.1-405b": dict(
        dim=16384, layers=126, heads=128, kv_heads=8, ffn=53248, vocab=128256, tied=False
    ),
    # Llama 2 7B (its params.json: no GQA, FFN 11,008, a 32K vocabulary; the same blocks)
    "llama2-7b": dict(
        dim=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000, tied=False
    ),
}
LLAMA_SMALL = dict(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, tied=False)
ROPE_THETA = 500000.0


class MixedPrecision(nn.Module):
    """Parameters kept in float32 (the optimizer's master weights), each cast to the compute
    dtype where it is used, as FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16) does
    (torchtitan's default): the cast is an operator of the layer, its backward casts the
    gradient back to float32."""

    compute_dtype = torch.bfloat16

    def w(self, p):
        return p.to(self.compute_dtype) if p.dtype != self.compute_dtype else p


class LlamaLinear(MixedPrecision):
    def __init__(self, din, dout):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dout, din))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        return F.linear(x, self.w(self.weight))


class RMSNorm(MixedPrecision):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.w(self.weight), self.eps)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def add_rope_tables(module: nn.Module, max_len: int, head_dim: int, theta: float) -> None:
    """The rotary embedding's cos and sin tables, (max_len, 1, head_dim), as non-persistent
    buffers `rope_cos` and `rope_sin` of `module` (they follow it to its device)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    module.register_buffer("rope_cos", freqs.cos(), persistent=False)
    module.register_buffer("rope_sin", freqs.sin(), persistent=False)


def rotary(x, cos, sin):
    """Rotary position embedding (Su et al. 2021), in float32 as torchtitan computes it."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = LlamaLinear(dim, heads * self.head_dim)
        self.wk = LlamaLinear(dim, kv_heads * self.head_dim)
        self.wv = LlamaLinear(dim, kv_heads * self.head_dim)
        self.wo = LlamaLinear(heads * self.head_dim, dim)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        rep = self.heads // self.kv_heads  # grouped-query attention: torchtitan's repeat_kv
        k = (
            k[:, :, :, None, :]
            .expand(b, t, self.kv_heads, rep, self.head_dim)
            .reshape(b, t, self.heads, self.head_dim)
        )
        v = (
            v[:, :, :, None, :]
            .expand(b, t, self.kv_heads, rep, self.head_dim)
            .reshape(b, t, self.heads, self.head_dim)
        )
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = (
            LlamaLinear(dim, hidden),
            LlamaLinear(hidden, dim),
            LlamaLinear(dim, hidden),
        )

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = LlamaAttention(dim, heads, kv_heads)
        self.feed_forward = SwiGLU(dim, ffn)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(MixedPrecision):
    """A Llama-3-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention)
    trained as torchtitan does: bfloat16 compute with float32 master weights (AdamW)."""

    def __init__(self, dim, layers, heads, kv_heads, ffn, vocab, tied=False, max_len=8192):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = LlamaLinear(dim, vocab)
        if tied:
            self.output.weight = self.tok_embeddings.weight
        add_rope_tables(self, max_len, dim // heads, ROPE_THETA)

    def forward(self, idx):
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = F.embedding(idx, self.w(self.tok_embeddings.weight))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW on float32 master copies of bfloat16 parameters, as Megatron-LM trains: each
    step casts the bfloat16 gradients to float32, runs AdamW (foreach) on the masters and
    copies them back into the parameters. Its `state` holds, per parameter, the master
    weight and AdamW's states (so the tracer names them "<parameter>.master", ...)."""

    def __init__(self, params, **adamw):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, **adamw)
        super().__init__(self.params, {})

    @property
    def state(self):  # parameter -> its master weight and AdamW states
        return {
            p: {"master": m, **self.inner.state.get(m, {})}
            for p, m in zip(self.params, self.masters, strict=True)
        }

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ sets it
        pass

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def step(self, closure=None):
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)


def _llama_loss(out, target):  # torchtitan: the logits in float32
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten(0, 1))


def llama_config(name: str, small: bool = False) -> dict:
    if small:
        return dict(LLAMA_SMALL)
    return dict(LLAMA[name])
