"""torchtitan's own Llama 3 (``torchtitan.models.llama3.Llama3Model``, torchtitan 0.3.0) and its own tensor +
sequence parallel layout, on CPU ranks, for ``bench/parallel.py --models titan``.

Needs ``pip install torchtitan==0.3.0 triton`` (torchtitan imports triton; nothing here runs it). What it
took to run torchtitan's recipe on gloo CPU ranks, all through torchtitan's own configuration, no patch:
its inner attention set to its own causal ``ScaledDotProductAttention`` (0.3.0 refuses "sdpa" as an
attention backend name for language models); the TP + SP sharding declarations attached to the config
before the model is built, as its Trainer does (``update_from_config``); the DTensor backend
("partial_dtensor") chosen in ``ParallelDims`` and globally (its loss asserts it); and ``ParallelDims``
handed our 1-D mesh (it would build its own on "cuda"). The RMSNorm weights' gradients come out as
``Partial`` DTensors (torchtitan leaves their sum to FSDP); ``full_tensor()`` and ``torch.optim`` add
them up."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn


class TitanLM(nn.Module):
    """``forward(ids, targets)``: torchtitan's ``cross_entropy_loss`` (a sum) over the token count, as its
    trainer takes it; on the TP model's vocabulary-sharded logits it is torchtitan's loss-parallel one."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(self.model(ids), targets) / targets.numel()


def _config(vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, seq: int):
    """torchtitan's debug-model recipe (``config_registry``) at these sizes, fused QKV, complex rotary
    embeddings, its causal SDPA; its TP + SP declarations attached."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention

    cfg = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)
        ),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq, theta=500000, scaling="llama"),
            attn_backend="flex",  # replaced below
        ),
    )
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(enable_sequence_parallel=True, spmd_backend="partial_dtensor")
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    return cfg


def build(vocab=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, seq=256, batch=4, seed=0):
    """The model (fp32, CPU, seeded) at the demo Llama's sizes, and a batch of token ids and targets."""
    cfg = _config(vocab, dim, n_layers, n_heads, n_kv_heads, seq)
    torch.manual_seed(seed)
    inner = cfg.build()
    inner.init_states(buffer_device=torch.device("cpu"))
    g = torch.Generator().manual_seed(seed + 1)
    ids, targets = (torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2))
    return TitanLM(inner).float(), (ids, targets)


def torchtitan_tp_sp(model: TitanLM, mesh) -> TitanLM:
    """``model`` laid out in place by torchtitan's own TP + SP (``Module.parallelize(parallel_dims)``, the
    call ``parallelize_llama`` makes) over the 1-D ``mesh``; no FSDP, no activation checkpointing."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    tp = mesh.size()
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp, spmd_backend="partial_dtensor"
    )
    dims._single_axis_meshes, dims._world_mesh = {"tp": mesh}, mesh
    model.model.parallelize(dims)
    return model
