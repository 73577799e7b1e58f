"""Reference models for tracing: no downloads, no torchvision.

Defaults follow the published architectures (ResNet: He et al. 2016; VGG: Simonyan &
Zisserman 2015; DenseNet-121: Huang et al. 2017; GPT-2 small: 12 x 768, 12 heads;
BERT-base: 12 x 768, 12 heads; Llama 3: Meta's published configurations, below; the
mixture-of-experts models Mixtral 8x7B and DeepSeek-V3: tracer.moe, with their sources).
`small=True` shrinks width/depth for fast CPU tests. Each entry of MODELS returns (model,
make_batch, loss_fn). Transformers take `layers=k` to build k of their identical decoder
layers (for tracing k and replicating them, tracer.layers).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


# -- ResNet ------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, width, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != width:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, width, 1, stride, bias=False), nn.BatchNorm2d(width)
            )

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + idt)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + idt)


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000, base=64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, base, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = base, []
        for i, n in enumerate(layers):
            width = base * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- VGG ---------------------------------------------------------------------------------------
VGG_CFG = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg19": [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        512,
        "M",
    ],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    ],
}


class VGG(nn.Module):
    def __init__(self, cfg, num_classes=1000, width_div=1, hidden=4096):
        super().__init__()
        layers, cin = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v // width_div, 3, padding=1), nn.ReLU(inplace=True)]
                cin = v // width_div
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(
            nn.Linear(cin * 49, hidden),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# -- DenseNet ----------------------------------------------------------------------------------
class DenseLayer(nn.Module):
    def __init__(self, cin, growth, bn_size=4):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, feats):
        x = torch.cat(feats, 1)
        x = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.Module):
    def __init__(self, n, cin, growth):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth) for i in range(n))

    def forward(self, x):
        feats = [x]
        for layer in self.layers:
            feats.append(layer(feats))
        return torch.cat(feats, 1)


class Transition(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)

    def forward(self, x):
        return self.pool(self.conv(F.relu(self.norm(x))))


class DenseNet(nn.Module):
    def __init__(self, blocks=(6, 12, 24, 16), growth=32, init=64, num_classes=1000):
        super().__init__()
        mods = [
            nn.Conv2d(3, init, 7, 2, 3, bias=False),
            nn.BatchNorm2d(init),
            nn.ReLU(True),
            nn.MaxPool2d(3, 2, 1),
        ]
        c = init
        for i, n in enumerate(blocks):
            mods.append(DenseBlock(n, c, growth))
            c += n * growth
            if i != len(blocks) - 1:
                mods.append(Transition(c, c // 2))
                c //= 2
        mods.append(nn.BatchNorm2d(c))
        self.features = nn.Sequential(*mods)
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(F.relu(self.features(x)), 1)
        return self.classifier(torch.flatten(x, 1))


# -- transformers ------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d, heads, causal):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d, heads, causal, pre_norm):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, heads, causal), MLP(d)
        self.pre_norm = pre_norm

    def forward(self, x):
        if self.pre_norm:  # GPT-2
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))  # BERT
        return self.ln2(x + self.mlp(x))


class Transformer(nn.Module):
    def __init__(self, vocab=50257, d=768, layers=12, heads=12, max_len=1024, causal=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.Sequential(*(Block(d, heads, causal, causal) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2 and BERT's masked-LM head

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(pos))
        return self.head(self.ln_f(x))


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
        hd = dim // heads
        inv = 1.0 / ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (max_len, 1, head_dim)
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

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


# -- registry --------------------------------------------------------------------------------
def _image_batch(image_size, classes):
    def make(batch_size, device):
        x = torch.randn(batch_size, 3, image_size, image_size, device=device)
        return x, torch.randint(0, classes, (batch_size,), device=device)

    return make


def _token_batch(seq_len, vocab):
    def make(batch_size, device):
        idx = torch.randint(0, vocab, (batch_size, seq_len), device=device)
        return idx, torch.randint(0, vocab, (batch_size, seq_len), device=device)

    return make


def _lm_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def build(
    name: str,
    small: bool = False,
    image_size: int = 224,
    seq_len: int = 128,
    layers: int | None = None,
    bf16_params: bool = False,
    capacity_factor: float | None = None,
):
    """Return (model, make_batch(batch_size, device), loss_fn) for a reference model.
    layers: build this many of a transformer's decoder layers (default: all of them).
    bf16_params (Llama): bfloat16 parameters, to train with MasterWeightAdamW (Megatron-LM's
    scheme) instead of float32 parameters cast where used (torchtitan's).
    capacity_factor (MoE models): token-dropping routing with this capacity factor; None:
    dropless (traced at the balanced load, tracer.moe)."""
    if layers is not None and name not in LAYERED:
        raise KeyError(f"{name} has no identical layers to trace a few of")
    classes = 10 if small else 1000
    base = 16 if small else 64
    img = _image_batch(image_size, classes)
    ce = F.cross_entropy
    if name == "resnet18":
        return ResNet(BasicBlock, [2, 2, 2, 2], classes, base), img, ce
    if name == "resnet50":
        return ResNet(Bottleneck, [3, 4, 6, 3], classes, base), img, ce
    if name == "resnet152":
        return ResNet(Bottleneck, [3, 8, 36, 3], classes, base), img, ce
    if name in VGG_CFG:
        return VGG(VGG_CFG[name], classes, 4 if small else 1, 256 if small else 4096), img, ce
    if name == "densenet121":
        blocks = (2, 2, 2, 2) if small else (6, 12, 24, 16)
        return DenseNet(blocks, 12 if small else 32, 24 if small else 64, classes), img, ce
    if name in ("gpt2", "bert"):
        vocab = 1000 if small else (50257 if name == "gpt2" else 30522)
        d, n, heads = (64, 2, 4) if small else (768, 12, 12)
        max_len = max(seq_len, 1024 if name == "gpt2" else 512)
        model = Transformer(vocab, d, layers or n, heads, max_len, causal=name == "gpt2")
        return model, _token_batch(seq_len, vocab), _lm_loss
    if name in LLAMA:
        cfg = llama_config(name, small)
        if layers is not None:
            cfg["layers"] = layers
        model = Llama(**cfg, max_len=max(seq_len, 8192 if not small else seq_len))
        if bf16_params:
            model.to(torch.bfloat16)
            model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
        return model, _token_batch(seq_len, cfg["vocab"]), _llama_loss
    if name in MOE_NAMES:
        from tracer.moe import MoETransformer, moe_config

        cfg = moe_config(name, small)
        if layers is not None:
            cfg["layers"] = layers
        model = MoETransformer(cfg, capacity_factor, max_len=max(seq_len, 4096), small=small)
        return model, _token_batch(seq_len, cfg["vocab"]), _llama_loss
    raise KeyError(name)


def num_layers(name: str, small: bool = False) -> int:
    """How many identical decoder layers a transformer has."""
    if name in LLAMA:
        return llama_config(name, small)["layers"]
    if name in MOE_NAMES:
        from tracer.moe import moe_config

        return moe_config(name, small)["layers"]
    return 2 if small else 12


# the mixture-of-experts models (tracer.moe)
MOE_NAMES = ("mixtral-8x7b", "deepseek-v3")
# model -> the module list of its identical layers (an MoE model's: its MoE layers)
LAYERED = {
    "gpt2": "blocks",
    "bert": "blocks",
    **{n: "layers" for n in LLAMA},
    **{n: "layers" for n in MOE_NAMES},
}


MODELS = (
    "resnet18",
    "resnet50",
    "resnet152",
    "vgg11",
    "vgg13",
    "vgg16",
    "vgg19",
    "densenet121",
    "gpt2",
    "bert",
    *LLAMA,
    *MOE_NAMES,
)
