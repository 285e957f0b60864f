"""The fixed policies on multi-layer models and other layouts: each block's structure is found on
its own, and ``save-all`` keeps what the forward makes (nothing run again in the backward)."""

import pytest
import torch
import torch.nn as nn
from helpers import TINY_GPT, partitioned, tiny_gpt, tiny_llama, train_side_by_side

import recompile_opt
from recompile_opt.models import GPT, Block, GPTConfig, example_batch
from recompile_opt.planner.policies import block_of


@pytest.mark.parametrize("n_layer,dropout", [(1, 0.0), (3, 0.0), (3, 0.1)])
def test_megatron_selective_recomputes_each_layers_qk_matmul_and_nothing_outside_attention(n_layer, dropout):
    # a later layer's attention descends from an earlier one's: the core must not span layers
    cfg = GPTConfig(**{**TINY_GPT, "n_layer": n_layer}, dropout=dropout)
    model, inputs = GPT(cfg), example_batch(cfg, 2)
    b, s = inputs[0].shape
    plan = recompile_opt.plan(model, inputs, policy="megatron-selective")
    assert plan.recompute_flops == n_layer * 2 * b * s * s * cfg.n_embd, plan
    outside = [e.name for e in plan.recomputed if ".attn" not in e.module]
    assert not outside, plan
    assert not [e.name for e in plan.recomputed if e.op in ("addmm", "mm")], plan


@pytest.mark.parametrize(
    "make", [lambda: tiny_gpt(dropout=0.1), tiny_llama], ids=["gpt-dropout", "llama-sdpa"]
)
def test_save_all_keeps_tuple_outputs_only_the_backward_reads(make):
    # dropout's mask and SDPA's logsumexp feed only the backward, yet the forward makes them: kept,
    # not remade by running dropout (replayed) or SDPA again in the backward
    model, inputs = make()
    part = partitioned(model, inputs, {"policy": "save-all"})
    plan = part.plans[-1]
    assert [e.name for e in plan.recomputed if e.reason != "view"] == [], plan
    assert plan.recompute_flops == 0 and plan.saved_bytes == plan.baseline_bytes
    ops = {str(n.target) for n in part.last_backward.graph.nodes if n.op == "call_function"}
    assert not [op for op in ops if "rng_state" in op or "flash_attention_for_cpu.default" in op], ops


def test_sdpa_without_dropout_is_recomputed_without_an_rng_state():
    model, inputs = tiny_llama()
    plan = recompile_opt.plan(model, inputs, policy="megatron-selective")
    assert [e.op for e in plan.recomputed].count("_scaled_dot_product_flash_attention_for_cpu") == 2, plan
    assert not [e.name for e in plan.saved if e.op == "rng_state"], plan
    assert plan.saved_bytes < plan.baseline_bytes


class _ViewEndingBlock(Block):
    """A block whose output is a view (``out.view(b, s, h)``)."""

    def forward(self, x):
        b, s, h = x.shape
        x = x + self.attn(self.ln_1(x))
        flat = x.view(b * s, h)
        return (flat + self.mlp(self.ln_2(flat))).view(b, s, h)


class _SequentialMLPBlock(Block):
    def __init__(self, cfg):
        super().__init__(cfg)
        h = cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))


class _SequentialGPT(nn.Sequential):
    """The model itself an ``nn.Sequential`` of an embedding and blocks, each MLP one too (module
    paths ``1.attn``, ``2.mlp.0``: no name before the first index, another index after it)."""

    def __init__(self, cfg):
        super().__init__(
            nn.Embedding(cfg.vocab_size, cfg.n_embd), *[_SequentialMLPBlock(cfg) for _ in range(cfg.n_layer)]
        )

    def forward(self, idx):
        return super().forward(idx).square().mean()


def test_full_keeps_each_block_output_when_a_block_ends_in_a_view():
    cfg = GPTConfig(**{**TINY_GPT, "n_layer": 3})
    plans = []
    for block in (Block, _ViewEndingBlock):
        torch.manual_seed(0)
        model = GPT(cfg)
        model.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        plans.append(recompile_opt.plan(model, example_batch(cfg, 2), policy="full"))
    plain, viewed = plans
    assert (viewed.saved_bytes, viewed.recompute_flops) == (plain.saved_bytes, plain.recompute_flops), viewed


def test_blocks_are_found_at_the_first_index_of_a_module_path():
    assert block_of("blocks.3.attn") == "blocks.3" and block_of("model.layers.10.mlp") == "model.layers.10"
    assert block_of("0.attn") == "0" and block_of("1.mlp.0") == "1" and block_of("lm_head") is None


def test_full_on_a_top_level_sequential_of_blocks_keeps_only_what_crosses_them():
    cfg = GPTConfig(**{**TINY_GPT, "n_layer": 3})
    torch.manual_seed(0)
    model, (idx, _) = _SequentialGPT(cfg), example_batch(cfg, 2)
    plan = recompile_opt.plan(model, (idx,), policy="full")
    kept = [e for e in plan.saved if e.reason not in ("param", "input")]
    assert {e.module for e in kept} <= {"", "0", "1", "2", "3"}, plan  # block outputs, nothing inside
    b, s = idx.shape
    assert plan.saved_bytes <= 4 * b * s * cfg.n_embd * 4 + 1024, plan  # the embedding + 3 outputs


def test_a_policy_that_recomputes_yet_keeps_no_less_than_save_all_says_so():
    """GPT-NeoX at 16 tokens: recomputing its attention cores (scores 16 x 16) needs the fused QKV output
    kept for the rotary recompute, so megatron-selective keeps more than save-all. The plan is the
    policy's as asked (gradients equal eager); its warning said "nothing is recomputed, as under
    save-all" while it recomputed 82 values."""
    transformers = pytest.importorskip("transformers")
    from test_hf_models import BATCH, DECODER, SEQ, VOCAB, WithLoss

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(**DECODER, attn_implementation="eager")
    model = WithLoss(transformers.GPTNeoXForCausalLM(config))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    options = {"policy": "megatron-selective", "compiler": "eager"}
    with pytest.warns(UserWarning, match="policy='megatron-selective'") as caught:
        plan = train_side_by_side(model, (ids, ids), options=options, steps=1, rtol=1e-4, atol=1e-5)
    (said,) = {str(w.message) for w in caught if "megatron-selective" in str(w.message)}
    save_all = recompile_opt.plan(model, (ids, ids), policy="save-all", compiler="eager")
    assert plan.recomputed and plan.saved_bytes >= save_all.saved_bytes  # the case the message is about
    assert "nothing is recomputed" not in said, said
    assert "no less than save-all's" in said and "attention cores" in said, said
