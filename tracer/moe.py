"""Mixture-of-experts reference models: Mixtral 8x7B and a DeepSeek-V3-style fine-grained MoE.

Where the numbers come from:
- `mixtral-8x7b`: mistralai/Mixtral-8x7B-v0.1's config.json (hidden_size 4096, 32 layers, 32
  heads, 8 key/value heads, intermediate_size 14336, num_local_experts 8,
  num_experts_per_tok 2, vocab 32000, rope_theta 1e6) and Jiang et al. 2024, "Mixtral of
  Experts" (softmax router over the 8 experts, top-2, the two weights renormalised).
- `deepseek-v3`: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv 2412.19437)
  section 4.2 and deepseek-ai/DeepSeek-V3's config.json: hidden 7168, 61 layers of which the
  first 3 dense (intermediate 18432), 58 MoE layers of 1 shared + 256 routed experts of
  intermediate 2048, top-8 with sigmoid affinities normalised among the chosen (times the
  routed scaling factor 2.5), a load-balancing bias added for the choice only; multi-head
  latent attention (128 heads, q rank 1536, kv rank 512, 128 + 64 rotary query/key head
  dims, 128 value head dim); vocab 129280; group-limited routing (`n_group` 8, `topk_group`
  4: each token's experts within 4 of 8 groups of 32, so on at most 4 nodes where a node
  holds a group), written to the metadata for DeepEP's dispatch (the traced routing is
  plain top-k: the operators are the same). Multi-token prediction with `mtp=D` (the
  report's section 2.2, D = 1 in its training; Megatron-Core's `mtp_num_layers`): D
  sequential modules after the main model, module k taking the main model's (or module
  k - 1's) final hidden state and the embedding of the token k ahead, each RMS-normed,
  concatenated and projected back (`eh_proj`, 2 x hidden to hidden), through one more MoE
  layer and a norm, to the shared output head and its own cross-entropy (weighted 0.3).
  Not modelled: FP8 training.

Routing with static shapes (so that a meta-tensor run, which cannot size a tensor by its
data, traces the same operators as a real one): each expert takes a fixed number of token
slots, `capacity` = ceil(tokens x top_k / experts x capacity_factor) (GShard's capacity),
filled with the tokens routed to it by gate weight (a token over capacity is dropped, an
unused slot has weight 0). Dropless routing (`capacity_factor=None`, Megatron-LM's and
DeepSeek's default) is traced at the balanced load, factor 1: the mode `ep` then scales
the experts' work to the loads its config gives. The routed experts run as grouped GEMMs
(torch.bmm over an (experts, slots, hidden) tensor, as Megatron-LM's GroupedMLP), so a
layer has a handful of operators however many experts it has, in one module
(`feed_forward.experts`) that the trace's metadata names (`moe`, docs/trace-format.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from tracer.llama import (
    LlamaAttention,
    LlamaLinear,
    MixedPrecision,
    RMSNorm,
    SwiGLU,
    _llama_loss,
    add_rope_tables,
    rotary,
)

MOE = {
    "mixtral-8x7b": dict(
        dim=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        vocab=32000,
        experts=8,
        top_k=2,
        expert_ffn=14336,
        shared=0,
        dense_layers=0,
        dense_ffn=0,
        gate="softmax",
        attention="gqa",
        rope_theta=1e6,
    ),
    "deepseek-v3": dict(
        dim=7168,
        layers=58,  # MoE layers, after the 3 dense ones (61 in all)
        heads=128,
        kv_heads=128,
        vocab=129280,
        experts=256,
        top_k=8,
        expert_ffn=2048,
        shared=1,
        dense_layers=3,
        dense_ffn=18432,
        gate="sigmoid",
        router_groups=8,
        router_group_topk=4,
        attention="mla",
        rope_theta=10000.0,
    ),
}
# the tiny variants (`small=True`): the same structure, CPU-fast
MOE_SMALL = {
    "mixtral-8x7b": dict(MOE["mixtral-8x7b"], dim=64, layers=2, heads=4, kv_heads=2, vocab=256)
    | dict(expert_ffn=96),
    "deepseek-v3": dict(MOE["deepseek-v3"], dim=64, layers=2, heads=4, kv_heads=4, vocab=256)
    | dict(experts=8, top_k=2, expert_ffn=32, dense_layers=1, dense_ffn=128)
    | dict(router_groups=4, router_group_topk=2),
}
MLA = dict(q_rank=1536, kv_rank=512, nope=128, rope=64, v=128)  # DeepSeek-V3's MLA dims
MLA_SMALL = dict(q_rank=32, kv_rank=16, nope=16, rope=8, v=16)
ROUTED_SCALE = 2.5  # DeepSeek-V3's routed_scaling_factor
EXPERT_MODULE = "feed_forward.experts"  # under each MoE layer: the routed experts


def capacity(tokens: int, experts: int, top_k: int, factor: float | None) -> int:
    """Token slots per expert: ceil(tokens x top_k / experts x factor), at most the tokens
    (a token picks an expert once); dropless (None) is factor 1, the balanced load."""
    return min(tokens, math.ceil(tokens * top_k / experts * (factor or 1.0)))


class GroupedExperts(MixedPrecision):
    """The routed experts' SwiGLU FFNs as grouped GEMMs: (experts, slots, dim) in and out."""

    def __init__(self, experts, dim, ffn):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, dim, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x):
        h = F.silu(torch.bmm(x, self.w(self.w1))) * torch.bmm(x, self.w(self.w3))
        return torch.bmm(h, self.w(self.w2))


class MoE(nn.Module):
    """Router (top-k over softmax or sigmoid affinities) -> capacity dispatch -> routed
    experts -> gate-weighted combine, plus optional shared experts on every token."""

    def __init__(self, dim, experts, top_k, expert_ffn, shared, gate, capacity_factor):
        super().__init__()
        self.experts_n, self.top_k, self.gate = experts, top_k, gate
        self.capacity_factor = capacity_factor
        self.router = LlamaLinear(dim, experts)
        if gate == "sigmoid":  # DeepSeek-V3's auxiliary-loss-free balancing bias
            self.register_buffer("score_bias", torch.zeros(experts))
        self.experts = GroupedExperts(experts, dim, expert_ffn)
        self.shared_experts = SwiGLU(dim, expert_ffn * shared) if shared else None

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        logits = self.router(flat).float()
        if self.gate == "softmax":  # Mixtral: softmax, top-k, renormalised
            scores = F.softmax(logits, dim=-1)
            top_w, top_i = scores.topk(self.top_k, dim=-1)
        else:  # DeepSeek-V3: sigmoid; the bias steers the choice, not the weights
            scores = torch.sigmoid(logits)
            top_i = (scores + self.score_bias).topk(self.top_k, dim=-1).indices
            top_w = scores.gather(1, top_i)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if self.gate == "sigmoid":
            top_w = top_w * ROUTED_SCALE
        # (tokens, experts): a token's gate weight where it is routed, 0 elsewhere
        weights = torch.zeros_like(scores).scatter(1, top_i, top_w)
        cap = capacity(b * t, self.experts_n, self.top_k, self.capacity_factor)
        slot_w, slot_i = weights.t().topk(cap, dim=-1)  # per expert its `cap` heaviest tokens
        routed = flat.index_select(0, slot_i.reshape(-1)).view(self.experts_n, cap, d)
        y = self.experts(routed) * slot_w.unsqueeze(-1).to(x.dtype)
        out = torch.zeros_like(flat).index_add(0, slot_i.reshape(-1), y.reshape(-1, d))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(b, t, d)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention: queries and keys/values through low-rank
    latents, a shared rotary key part per token, value heads narrower than query heads."""

    def __init__(self, dim, heads, q_rank, kv_rank, nope, rope, v):
        super().__init__()
        self.heads, self.nope, self.rope, self.v = heads, nope, rope, v
        self.wq_a, self.q_norm = LlamaLinear(dim, q_rank), RMSNorm(q_rank)
        self.wq_b = LlamaLinear(q_rank, heads * (nope + rope))
        self.wkv_a, self.kv_norm = LlamaLinear(dim, kv_rank + rope), RMSNorm(kv_rank)
        self.wkv_b = LlamaLinear(kv_rank, heads * (nope + v))
        self.wo = LlamaLinear(heads * v, dim)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h, nope, rope = self.heads, self.nope, self.rope
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(b, t, h, nope + rope)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        kv, k_rope = self.wkv_a(x).split([self.kv_norm.weight.shape[0], rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, t, h, nope + self.v)
        k_nope, v = kv.split([nope, self.v], dim=-1)
        q_rope = rotary(q_rope, cos, sin)
        k_rope = rotary(k_rope.unsqueeze(2), cos, sin).expand(b, t, h, rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        # values padded to the query/key head size, so that one fused attention kernel
        # runs (FlashAttention-based MLA kernels do the same; with unequal sizes PyTorch
        # falls back to unfused matrix products holding the whole score matrix)
        v = F.pad(v, (0, nope + rope - self.v))
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )[..., : self.v]
        return self.wo(y.transpose(1, 2).reshape(b, t, h * self.v))


class MoEBlock(nn.Module):
    def __init__(self, attention, dim, ffn_module):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention, self.feed_forward = attention, ffn_module

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class MultiTokenPrediction(nn.Module):
    """One of DeepSeek-V3's MTP modules (module docstring): the hidden state before and the
    embedding of the token k ahead, each normed, concatenated and projected, through one
    transformer block and a norm."""

    def __init__(self, dim, block):
        super().__init__()
        self.hnorm, self.enorm = RMSNorm(dim), RMSNorm(dim)
        self.eh_proj = LlamaLinear(2 * dim, dim)
        self.block, self.norm = block, RMSNorm(dim)

    def forward(self, h, ahead, cos, sin):
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(ahead)], dim=-1))
        return self.block(x, cos, sin)


MTP_WEIGHT = 0.3  # the report's lambda for the MTP losses (its first 10T tokens)


def mtp_loss(out, target):
    """The main cross-entropy (in float32, as the Llama models') plus MTP_WEIGHT x the mean
    of the MTP modules' (module k predicts the token k ahead of the main target)."""
    main, *extra = out
    loss = _llama_loss(main, target)
    ahead = [
        F.cross_entropy(o.flatten(0, 1).float(), torch.roll(target, -k, 1).flatten(0, 1))
        for k, o in enumerate(extra, start=1)
    ]
    return loss + MTP_WEIGHT * sum(ahead) / len(ahead)


class MoETransformer(MixedPrecision):
    """A decoder of `dense_layers` SwiGLU layers (module list `dense_layers`) then `layers`
    identical MoE layers (`layers`, the ones `--layers K` traces K of), trained as the
    Llama models are (bfloat16 compute, float32 master weights, AdamW); with `mtp` D, D
    multi-token prediction modules (`mtp`) after them, sharing the embedding and the
    output head: it returns the main logits and each module's."""

    def __init__(self, cfg: dict, capacity_factor=None, max_len=4096, small=False, mtp=0):
        super().__init__()
        dim, heads = cfg["dim"], cfg["heads"]
        mla = MLA_SMALL if small else MLA
        self.tok_embeddings = nn.Embedding(cfg["vocab"], dim)

        def attention():
            if cfg["attention"] == "mla":
                return MLAttention(dim, heads, **mla)
            return LlamaAttention(dim, heads, cfg["kv_heads"])

        def moe():
            return MoE(
                dim,
                cfg["experts"],
                cfg["top_k"],
                cfg["expert_ffn"],
                cfg["shared"],
                cfg["gate"],
                capacity_factor,
            )

        self.dense_layers = nn.ModuleList(
            MoEBlock(attention(), dim, SwiGLU(dim, cfg["dense_ffn"]))
            for _ in range(cfg["dense_layers"])
        )
        self.layers = nn.ModuleList(MoEBlock(attention(), dim, moe()) for _ in range(cfg["layers"]))
        self.norm = RMSNorm(dim)
        self.mtp = nn.ModuleList(
            MultiTokenPrediction(dim, MoEBlock(attention(), dim, moe())) for _ in range(mtp)
        )
        self.output = LlamaLinear(dim, cfg["vocab"])
        hd = mla["rope"] if cfg["attention"] == "mla" else dim // heads
        add_rope_tables(self, max_len, hd, cfg["rope_theta"])

    def forward(self, idx):
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = F.embedding(idx, self.w(self.tok_embeddings.weight))
        for layer in [*self.dense_layers, *self.layers]:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if not len(self.mtp):
            return logits
        out = [logits]
        for k, module in enumerate(self.mtp, start=1):  # the token k ahead's embedding
            ahead = F.embedding(torch.roll(idx, -k, 1), self.w(self.tok_embeddings.weight))
            x = module(x, ahead, cos, sin)
            out.append(self.output(module.norm(x)))
        return tuple(out)


def moe_config(name: str, small: bool = False) -> dict:
    return dict((MOE_SMALL if small else MOE)[name])


def moe_metadata(name, small, batch_size, seq_len, capacity_factor, mtp=0) -> dict:
    """The trace's `moe` metadata (docs/trace-format.md): what mode `ep` needs to find the
    routed experts' operators and weights and to size their tokens."""
    cfg = moe_config(name, small)
    tokens = batch_size * seq_len
    return {
        "expert_module": EXPERT_MODULE,
        "num_experts": cfg["experts"],
        "top_k": cfg["top_k"],
        "hidden": cfg["dim"],
        "expert_ffn": cfg["expert_ffn"],
        "shared_experts": cfg["shared"],
        "moe_layers": cfg["layers"],
        "mtp_layers": mtp,
        "dense_layers": cfg["dense_layers"],
        "gate": cfg["gate"],
        "capacity_factor": capacity_factor,
        "dropless": capacity_factor is None,
        "tokens": tokens,
        "capacity": capacity(tokens, cfg["experts"], cfg["top_k"], capacity_factor),
        "dispatch_dtype": "bfloat16",
        "router_groups": cfg.get("router_groups"),
        "router_group_topk": cfg.get("router_group_topk"),
        "source": "tracer.moe." + ("MOE_SMALL" if small else "MOE") + f"[{name!r}]",
    }
