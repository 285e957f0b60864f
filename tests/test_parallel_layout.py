"""The tensor-parallel layout found from the graph (recompile_opt.parallel.layout, issue 22 step 3): which
linears are column- and row-parallel, the fused QKV's strided shard, the norms on sequence shards, and
the pairs left replicated with a warning that names them. Captured on the meta device: nothing runs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from recompile_opt import models
from recompile_opt.parallel.layout import find_layout

SEQ = 32


def _tokens():
    return torch.zeros(2, SEQ, dtype=torch.long, device="meta")


def _gpt(n_head=4, n_embd=64):
    cfg = models.GPTConfig(n_layer=2, n_head=n_head, n_embd=n_embd, block_size=SEQ, vocab_size=128)
    return models.GPT(cfg).to("meta")


def _llama():
    cfg = models.LlamaConfig(n_layer=2, n_head=4, n_embd=64, block_size=SEQ, vocab_size=128)
    return models.Llama(cfg).to("meta")


def _styles(layout) -> dict:
    return {m.module: (m.style, m.placement) for m in layout.modules}


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_fused_qkv_is_a_strided_column_and_its_hard_coded_heads_split(tp):
    """nanoGPT's ``c_attn`` output ``[q | k | v]`` is split in three, each viewed as (4 heads, 16) with
    the head count from the module, not -1: each rank needs its heads of each of q, k and v."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept replicated
        layout = find_layout(_gpt(), (_tokens(), _tokens()), tp)
    styles = _styles(layout)
    for b in ("blocks.0", "blocks.1"):
        assert styles[f"{b}.attn.c_attn"] == ("column", "_StridedShard(0, 3)")
        assert styles[f"{b}.attn.c_proj"] == ("row", "Shard(1)")
        assert styles[f"{b}.mlp.c_fc"] == ("column", "Shard(0)")
        assert styles[f"{b}.mlp.c_proj"] == ("row", "Shard(1)")
        assert styles[f"{b}.ln_1"][0] == styles[f"{b}.ln_2"][0] == "sequence"
    assert (
        styles["wte"] == ("vocab", "Shard(0)") and styles["wpe"][0] == "replicated"
    )  # positions, not tokens
    # the LM head: column-parallel, its logits gathered whole for the loss (torch's
    # ColwiseParallel(output_layouts=Replicate())), not every rank computing all of them
    assert styles["ln_f"][0] == "sequence" and styles["lm_head"] == ("column", "Shard(0)")
    assert list(layout.gathered) == ["cross_entropy_loss"]


def test_llama_separate_qkv_with_rotary_and_swiglu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        styles = _styles(find_layout(_llama(), (_tokens(), _tokens()), 2))
    for b in ("blocks.0", "blocks.1"):
        for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            assert styles[f"{b}.{w}"] == ("column", "Shard(0)"), w
        assert styles[f"{b}.attention.wo"] == styles[f"{b}.feed_forward.w2"] == ("row", "Shard(1)")
        assert (
            styles[f"{b}.attention_norm"][0] == styles[f"{b}.ffn_norm"][0] == "sequence"
        )  # hand-written RMSNorm
    assert styles["tok_embeddings"][0] == "vocab" and styles["norm"][0] == "sequence"
    assert styles["output"] == ("column", "Shard(0)")


def test_complex_rotary_embeddings_keep_the_heads_sharded():
    """``view_as_complex`` / ``view_as_real`` (Meta's reference Llama, torchtitan) on a rank's heads: the
    attention stays column / row parallel, nothing is kept replicated."""
    from test_parallel_rewrite import ComplexRotaryAttention

    model = _llama()
    for block in model.blocks:
        block.attention.__class__ = ComplexRotaryAttention
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        styles = _styles(find_layout(model, (_tokens(), _tokens()), 2))
    for b in ("blocks.0", "blocks.1"):
        for w in ("wq", "wk", "wv"):
            assert styles[f"{b}.attention.{w}"] == ("column", "Shard(0)"), w
        assert styles[f"{b}.attention.wo"] == ("row", "Shard(1)")


def test_heads_not_divisible_leave_attention_replicated_with_a_warning_naming_it():
    """4 heads over 8 ranks: the attention pair stays replicated (and its warning says why); the MLP's
    256 features still split."""
    with pytest.warns(UserWarning) as record:
        layout = find_layout(_gpt(n_head=4, n_embd=64), (_tokens(), _tokens()), 8)
    styles = _styles(layout)
    assert styles["blocks.0.attn.c_attn"][0] == styles["blocks.0.attn.c_proj"][0] == "replicated"
    assert styles["blocks.0.mlp.c_fc"][0] == "column" and styles["blocks.0.mlp.c_proj"][0] == "row"
    messages = [str(w.message) for w in record]
    assert any("blocks.0.attn.c_attn" in m and "not divisible by 8" in m for m in messages), messages
    assert "blocks.0.attn.c_attn" in str(layout) and "warning" in str(layout)


class _OddMLP(nn.Module):
    """An op between the pair that mixes features (a running sum over them): not shardable."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)).cumsum(-1))


def test_an_unknown_op_between_the_pair_leaves_it_replicated_with_a_warning():
    with pytest.warns(UserWarning, match=r"up: kept replicated: cumsum"):
        styles = _styles(find_layout(_OddMLP().to("meta"), (torch.zeros(2, SEQ, 16, device="meta"),), 2))
    assert styles["up"][0] == styles["down"][0] == "replicated"


def test_a_bare_transformer_block_takes_hidden_states():
    cfg = models.GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=SEQ)
    block = models.Block(cfg).to("meta")
    styles = _styles(find_layout(block, (torch.zeros(2, SEQ, 64, device="meta"),), 2))
    assert styles["attn.c_attn"] == ("column", "_StridedShard(0, 3)") and styles["mlp.c_proj"][0] == "row"
    assert styles["ln_1"][0] == "sequence"
    assert "ln_1" not in _styles(
        find_layout(block, (torch.zeros(2, SEQ, 64, device="meta"),), 2, sequence_parallel=False)
    )


def test_a_bad_rank_count_is_an_error_naming_it():
    with pytest.raises(ValueError, match="tp must be a positive int"):
        find_layout(_OddMLP(), (torch.zeros(2, 16),), 0)


class _HFLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def test_hugging_face_llama_with_fewer_kv_heads():
    """``LlamaForCausalLM`` with grouped-query attention (4 query heads, 2 KV heads, t = 2): every
    projection pairs up as Megatron's, the RMSNorms on sequence shards."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        model = _HFLoss(transformers.LlamaForCausalLM(cfg))
    styles = _styles(find_layout(model, (_tokens(),), 2))
    layer = "model.model.layers.0"
    for w in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert styles[f"{layer}.{w}"] == ("column", "Shard(0)"), w
    assert styles[f"{layer}.self_attn.o_proj"] == styles[f"{layer}.mlp.down_proj"] == ("row", "Shard(1)")
    assert styles[f"{layer}.input_layernorm"][0] == styles["model.model.norm"][0] == "sequence"
    assert styles["model.model.embed_tokens"][0] == "vocab" and styles["model.lm_head"][0] == "column"


def test_hugging_face_gpt2_conv1d_pairs_with_its_weight_split_on_the_output_dimension():
    """GPT-2's ``Conv1D`` multiplies by ``addmm`` with its weight laid out ``[in, out]``: it pairs as a
    linear does, its weight split on dimension 1 (a row's on 0), the fused QKV strided, no warning."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=64)
    with torch.device("meta"):
        model = _HFLoss(transformers.GPT2LMHeadModel(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        styles = _styles(find_layout(model, (_tokens(),), 2))
    block = "model.transformer.h.0"
    assert styles[f"{block}.attn.c_attn"] == ("column", "_StridedShard(1, 3)")
    assert styles[f"{block}.mlp.c_fc"] == ("column", "Shard(1)")
    assert styles[f"{block}.attn.c_proj"] == styles[f"{block}.mlp.c_proj"] == ("row", "Shard(0)")


class _MatmulMLP(nn.Module):
    """Weights multiplied with ``@``, not ``F.linear``: not recognised as linear layers."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(16, 32)), nn.Parameter(torch.randn(32, 16))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def test_a_weight_multiplied_outside_a_linear_is_named_in_a_warning_not_left_silently():
    with pytest.warns(UserWarning, match="its weight is multiplied by"):
        find_layout(_MatmulMLP(), (torch.zeros(2, 16),), 2)
