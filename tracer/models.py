"""Reference models for tracing: no downloads, no torchvision.

Defaults follow the published architectures (ResNet: He et al. 2016; VGG: Simonyan &
Zisserman 2015; DenseNet-121: Huang et al. 2017; GPT-2 small: 12 x 768, 12 heads;
BERT-base: 12 x 768, 12 heads; Llama 3 and Llama 2 7B: Meta's published configurations, below; the
mixture-of-experts models Mixtral 8x7B and DeepSeek-V3: tracer.moe, with their sources).
`small=True` shrinks width/depth for fast CPU tests. Each entry of MODELS returns (model,
make_batch, loss_fn). Transformers take `layers=k` to build k of their identical decoder
layers (for tracing k and replicating them, tracer.layers).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tracer.llama import (  # noqa: F401 (handed on: tracer.cli and the tests import them here)
    LLAMA,
    Llama,
    MasterWeightAdamW,
    _llama_loss,
    llama_config,
)


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
    mtp: int = 0,
):
    """Return (model, make_batch(batch_size, device), loss_fn) for a reference model.
    layers: build this many of a transformer's decoder layers (default: all of them).
    bf16_params (Llama): bfloat16 parameters, to train with MasterWeightAdamW (Megatron-LM's
    scheme) instead of float32 parameters cast where used (torchtitan's).
    capacity_factor (MoE models): token-dropping routing with this capacity factor; None:
    dropless (traced at the balanced load, tracer.moe). mtp (DeepSeek-V3): this many
    multi-token prediction modules (tracer.moe)."""
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
        from tracer.moe import MoETransformer, moe_config, mtp_loss

        cfg = moe_config(name, small)
        if layers is not None:
            cfg["layers"] = layers
        model = MoETransformer(
            cfg, capacity_factor, max_len=max(seq_len, 4096), small=small, mtp=mtp
        )
        return model, _token_batch(seq_len, cfg["vocab"]), mtp_loss if mtp else _llama_loss
    raise KeyError(name)


def num_layers(name: str, small: bool = False) -> int:
    """How many identical decoder layers a transformer has."""
    if name in LLAMA:
        return llama_config(name, small)["layers"]
    if name in MOE_NAMES:
        from tracer.moe import moe_config

        return moe_config(name, small)["layers"]
    return 2 if small else 12


# the mixture-of-experts models (tracer.moe); those with multi-token prediction modules
MOE_NAMES = ("mixtral-8x7b", "deepseek-v3")
MTP_NAMES = ("deepseek-v3",)
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
