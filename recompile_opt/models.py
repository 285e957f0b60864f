"""Small reference models for the demo, the tests and the benchmarks.

Three shapes of network the planner must handle, each written the plain way a user would:

* :class:`GPT` — Megatron-style GPT (Korthikanti et al. 2022, Fig. 2): LayerNorm, one QKV projection,
  an *explicit* attention core (QK^T, scale, causal mask, softmax, dropout, @V) that materialises the
  s x s attention matrix, output projection, dropout, and a GELU MLP. Follows nanoGPT's layout.
* :class:`Llama` — Llama-style: RMSNorm, rotary position embeddings, SwiGLU MLP and
  ``F.scaled_dot_product_attention`` (no s x s tensor is kept).
* :class:`MLP` — a plain multi-layer perceptron, the degenerate case.

Transformer blocks live in an ``nn.ModuleList`` named ``blocks``; the ``full`` policy finds them from the
graph (repeated module paths), not from these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256
    vocab_size: int = 512
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """Megatron's attention: the core (QK^T ... @V) is what selective recompute drops."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer(
            "causal_mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q = q.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        k = k.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        v = v.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.causal_mask[:, :, :s, :s], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).contiguous().view(b, s, h)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256
    vocab_size: int = 512
    ffn_hidden: int = 0  # 0: the Llama rule, 2/3 of 4h rounded up to a multiple of 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # as GPT's: embeddings, attention probabilities (SDPA's dropout_p), residuals; at 0.0 the traced
    # graph is the one without dropout modules (Dynamo drops a p=0 dropout), so stored plans still hold
    dropout: float = 0.0

    @property
    def hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return 64 * math.ceil(int(2 * 4 * self.n_embd / 3) / 64)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., ::2], x[..., 1::2]) — real arithmetic, so the graph has no complex ops."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class LlamaAttention(nn.Module):
    rotate = staticmethod(apply_rotary)  # the rotary embedding (a subclass may write it another way)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head = config.n_head
        self.wq = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.wo = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        shape = (b, s, self.n_head, h // self.n_head)
        q = self.rotate(self.wq(x).view(shape), cos, sin).transpose(1, 2)
        k = self.rotate(self.wk(x).view(shape), cos, sin).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(b, s, h)))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.hidden, bias=False)
        self.w3 = nn.Linear(config.n_embd, config.hidden, bias=False)
        self.w2 = nn.Linear(config.hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        cos, sin = self.rope_cos[:s].view(1, s, 1, -1), self.rope_sin[:s].view(1, s, 1, -1)
        x = self.drop(self.tok_embeddings(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MLP(nn.Module):
    """``forward(x, y)`` returns the mean squared error of a GELU MLP."""

    def __init__(self, sizes: tuple[int, ...] = (64, 256, 256, 64)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, y)


def example_batch(config, batch: int, *, seed: int = 0, device: str | torch.device = "cpu"):
    """Random token ids and targets for a GPT/Llama config: ``(idx, targets)``."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, config.block_size)
    idx = torch.randint(0, config.vocab_size, shape, generator=g)
    tgt = torch.randint(0, config.vocab_size, shape, generator=g)
    return idx.to(device), tgt.to(device)


class GPTLayer(nn.Module):
    """One Megatron-style transformer layer as a stand-alone model: ``forward(x)`` returns a scalar,
    so a layer at paper scale (hidden states in, on the meta device) can be planned on its own."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.block = Block(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).float().sum()


def paper_layer(
    h: int,
    heads: int,
    s: int = 2048,
    b: int = 1,
    *,
    dtype=torch.bfloat16,
    device: str = "meta",
    dropout: float = 0.1,
):
    """A GPT layer at a Korthikanti et al. shape (e.g. GPT-3 175B: h=12288, 96 heads) and its input."""
    cfg = GPTConfig(n_layer=1, n_head=heads, n_embd=h, block_size=s, dropout=dropout)
    with torch.device(device):
        layer = GPTLayer(cfg).to(dtype)
        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    return layer, x


# -- factories: ``MODULE:FACTORY`` targets for ``recompile-opt plan`` (each returns model, inputs) --


def demo_gpt(
    n_layer: int = 2,
    n_embd: int = 256,
    seq: int = 256,
    batch: int = 4,
    dropout: float = 0.0,
    vocab: int = 512,
):
    """The demo's and the benchmark's GPT: 2 layers, h=256, s=256, b=4, fp32, on the CPU."""
    cfg = GPTConfig(
        n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=seq, vocab_size=vocab, dropout=dropout
    )
    torch.manual_seed(0)
    return GPT(cfg), example_batch(cfg, batch)


def demo_gpt_vocab_2048():
    """The benchmark GPT with vocabulary 2048 (``bench/compare.py --vocab 2048``): the logits, their
    log-softmax and gradient each as large as a block's activations."""
    return demo_gpt(vocab=2048)


def demo_llama(n_layer: int = 2, n_embd: int = 256, seq: int = 256, batch: int = 4):
    cfg = LlamaConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=seq, vocab_size=512)
    torch.manual_seed(0)
    return Llama(cfg), example_batch(cfg, batch)


class TorchEncoderLM(nn.Module):
    """torch's own ``nn.TransformerEncoder`` between an embedding and a language-model head: a model
    written outside this project (its layers' names, its fused attention), for the planning-time bench."""

    def __init__(self, n_layer: int = 2, d_model: int = 64, heads: int = 4, vocab: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx, targets):
        logits = self.head(self.encoder(self.embed(idx)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def demo_encoder(n_layer: int = 2, d_model: int = 64, seq: int = 256, batch: int = 4):
    """A 2-layer ``nn.TransformerEncoder`` LM (d_model 64, s=256, b=4, fp32, CPU)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return TorchEncoderLM(n_layer, d_model), (
        torch.randint(0, 512, (batch, seq), generator=g),
        torch.randint(0, 512, (batch, seq), generator=g),
    )


def gpt3_175b_layer():
    """One GPT-3 175B layer (h=12288, 96 heads, s=2048, b=1, bf16) on the meta device."""
    model, x = paper_layer(12288, 96)
    return model, (x,)
