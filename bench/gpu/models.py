"""A case's model and batch on its device: the demo GPT and Llama, a tiny Hugging Face Llama, and the
GPU-sized GPT of the performance part (with SDPA attention).

Weights are drawn under seed 0 on the CPU and then moved, so the CPU and the GPU check the same model.
"""

from __future__ import annotations

# tests/helpers.py's TINY_GPT: 2 layers small enough for a CPU test to compile in seconds
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
TINY_BATCH = 2
# the performance GPT: GPT-2 medium's width at 8 layers, s=2048, b=8 (the H200 table)
PERF = dict(vocab_size=50304, n_embd=1024, n_head=16, n_layer=8, block_size=2048)
PERF_BATCH = 8
PERF_TINY = dict(vocab_size=512, n_embd=64, n_head=4, n_layer=2, block_size=64)
# test_hf_models.py's decoder, and one at the demo's width
HF_TINY = dict(
    vocab_size=128,
    max_position_embeddings=64,
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
)
HF_DEMO = dict(
    vocab_size=512,
    max_position_embeddings=256,
    num_hidden_layers=2,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build(name: str, *, device: str, tiny: bool):
    """``(model, (idx, targets))`` of a correctness model (gpt | llama | hf-llama) on ``device``;
    ``model(idx, targets)`` is the loss."""
    import torch

    from recompile_opt import models

    if name == "hf-llama":
        model, batch = _hf_llama(tiny)
    elif tiny:
        cls, cfg_cls = (models.GPT, models.GPTConfig) if name == "gpt" else (models.Llama, models.LlamaConfig)
        cfg = cfg_cls(**TINY)
        torch.manual_seed(0)
        model, batch = cls(cfg), models.example_batch(cfg, TINY_BATCH)
    else:
        model, batch = getattr(models, f"demo_{name}")()
    return model.to(device), tuple(t.to(device) for t in batch)


def _hf_llama(tiny: bool):
    """A randomly initialised ``LlamaForCausalLM`` (nothing downloaded), its own loss on ``labels``;
    eager attention as in tests/test_hf_models.py. ImportError when transformers is missing."""
    import torch
    import transformers

    class WithLoss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss

    shape = (2, 16) if tiny else (4, 256)
    cfg = transformers.LlamaConfig(**(HF_TINY if tiny else HF_DEMO), attn_implementation="eager")
    torch.manual_seed(0)
    model = WithLoss(transformers.LlamaForCausalLM(cfg))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, shape, generator=g)
    return model, (idx, idx.clone())


def perf_gpt(*, device: str, tiny: bool):
    """The performance part's GPT (``recompile_opt.models.GPT``, dropout 0) with every attention core
    replaced by ``F.scaled_dot_product_attention`` (causal), fp32 parameters, and its batch."""
    import torch

    from recompile_opt import models

    cfg = models.GPTConfig(**(PERF_TINY if tiny else PERF), dropout=0.0)
    torch.manual_seed(0)
    model = models.GPT(cfg)
    sdpa = _sdpa_attention_class()
    for block in model.blocks:
        block.attn.__class__ = sdpa
        del block.attn.causal_mask  # SDPA's is_causal replaces the s x s mask buffer
    batch = models.example_batch(cfg, 2 if tiny else PERF_BATCH)
    return model.to(device), tuple(t.to(device) for t in batch)


def _sdpa_attention_class():
    """``CausalSelfAttention`` with its explicit core (QK^T, mask, softmax, @V) as one SDPA call: the
    same parameters under the same names, no s x s tensor."""
    import torch.nn.functional as F

    from recompile_opt.models import CausalSelfAttention

    class SDPACausalSelfAttention(CausalSelfAttention):
        def forward(self, x):
            b, s, h = x.shape
            shape = (b, s, self.n_head, h // self.n_head)
            q, k, v = (t.view(shape).transpose(1, 2) for t in self.c_attn(x).split(h, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h)))

    return SDPACausalSelfAttention
