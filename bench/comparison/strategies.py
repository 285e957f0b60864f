"""What each strategy is, and how a worker builds, checkpoints and compiles the model for it.

A strategy is a plain spec dict (:data:`STRATEGIES`): its kind (eager | compile | ours | external),
block checkpointing ("full") or attention-core checkpointing ("selective"), functorch config and our
backend's options.  :func:`prepare` turns a spec into the callable a worker times; keeping specs as
data lets the driver list, validate and forward them without importing torch.
"""

from __future__ import annotations

import functools
import importlib
import math

from .config import REPO

ROCKMATE_RUNNER = REPO / "bench" / "rockmate_runner.py"
ROCKMATE_PYTHON = "/work/rockmate-venv/bin/python"

BUDGETS = (0.5, 0.2, 0.0)  # torch's activation_memory_budget and our memory_budget alike

# name -> how to build it: kind (eager | compile | ours | external), block checkpointing
# ("full") or attention-core checkpointing ("selective"), functorch config, backend options.
STRATEGIES: dict[str, dict] = {
    "eager": {"kind": "eager"},
    "eager-full-ckpt": {"kind": "eager", "ckpt": "full"},
    "eager-selective": {"kind": "eager", "ckpt": "selective"},
    "compile": {"kind": "compile"},
    **{
        f"compile-amb-{b}": {"kind": "compile", "functorch": {"activation_memory_budget": b}}
        for b in BUDGETS + (0.05,)
    },
    "compile-amb-ilp-0.2": {
        "kind": "compile",
        "needs": ["scipy"],
        "functorch": {"activation_memory_budget": 0.2, "activation_memory_budget_solver": "ilp"},
    },
    "compile-full-ckpt": {"kind": "compile", "ckpt": "full"},
    "ours-none": {"kind": "ours", "options": {}},
    **{f"ours-{b}": {"kind": "ours", "options": {"memory_budget": b}} for b in BUDGETS},
    **{
        f"ours-{p}": {"kind": "ours", "options": {"policy": p}}
        for p in ("save-all", "full", "megatron-selective")
    },
    # one budget pair and 15 s per block ILP: a bounded attempt (bench/ROCKMATE.md: CBC found no
    # solution in 15 s or 90 s per solve, nor in 15 min without a limit); it holds the timing lock
    "rockmate": {
        "kind": "external",
        "runner": ROCKMATE_RUNNER,
        "runner_args": [
            "--budget-frac",
            "0.5",
            "--nb-budget-save",
            "1",
            "--nb-budget-peak",
            "1",
            "--ilp-seconds",
            "15",
        ],
        "note": "budget 0.5 x eager's saved bytes",
    },
}
PEAK_PREFIX = "ours-peak-"
# any ours-* strategy with option chunks set: "auto" is the default (the planner's mini-sequence chunking)
CHUNKS_SUFFIXES = {"+nochunks": False, "+chunks": "auto"}


def strategy(name: str) -> dict:
    """The spec of a strategy: a fixed entry of STRATEGIES, or ``ours-peak-SIZE`` for any SIZE that
    ``peak_memory`` accepts. Raises KeyError naming the accepted strategies otherwise."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    for suffix, chunks in CHUNKS_SUFFIXES.items():
        if name.endswith(suffix) and name.startswith("ours-"):
            spec = strategy(name[: -len(suffix)])
            return {**spec, "options": {**spec["options"], "chunks": chunks}}
    if name.startswith(PEAK_PREFIX):
        from recompile_opt.options import OptionError, parse_bytes  # lazy: the driver needs no torch

        size = name[len(PEAK_PREFIX) :]
        try:
            parse_bytes("peak_memory", size)
        except OptionError as e:
            raise KeyError(f"strategy {name!r}: {e}") from None
        return {"kind": "ours", "options": {"peak_memory": size}}
    raise KeyError(
        f"unknown strategy {name!r}; choose from {list(STRATEGIES)} or {PEAK_PREFIX}SIZE "
        f"(SIZE with units, e.g. 27MiB), each ours-* also with {' or '.join(CHUNKS_SUFFIXES)}"
    )


DEFAULT_STRATEGIES = [
    "eager",
    "eager-full-ckpt",
    "eager-selective",
    "compile",
    "compile-amb-0.5",
    "compile-amb-0.2",
    "compile-amb-0.0",
    "compile-full-ckpt",
    "ours-none",
    "ours-0.5",
    "ours-0.2",
    "ours-0.0",
    "ours-save-all",
    "ours-full",
    "ours-megatron-selective",
    "rockmate",
]


def build_model(cfg: dict):
    """Model and batch from ``recompile_opt.models``, weights drawn under seed 0."""
    import torch

    from recompile_opt import models

    if cfg["model"] == "gpt":
        config = models.GPTConfig(
            n_layer=cfg["layers"],
            n_head=cfg["heads"],
            n_embd=cfg["embd"],
            block_size=cfg["seq"],
            vocab_size=cfg["vocab"],
            dropout=cfg["dropout"],
        )
        cls = models.GPT
    else:
        config = models.LlamaConfig(
            n_layer=cfg["layers"],
            n_head=cfg["heads"],
            n_embd=cfg["embd"],
            block_size=cfg["seq"],
            vocab_size=cfg["vocab"],
        )
        cls = models.Llama
    torch.manual_seed(0)
    model = cls(config)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    tgt = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return model, idx, tgt


def checkpoint_blocks(model) -> None:
    """Wrap every module of ``model.blocks`` in non-reentrant activation checkpointing."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args):
            return checkpoint(self.block, *args, use_reentrant=False)

    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block)


def _gpt_core(attn, q, k, v):
    """``CausalSelfAttention``'s core, as in ``recompile_opt.models`` (QK^T ... @V)."""
    import torch.nn.functional as F

    s = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(~attn.causal_mask[:, :, :s, :s], float("-inf"))
    return attn.attn_dropout(F.softmax(att, dim=-1)) @ v


def _gpt_attention_selective(attn, x):
    """``CausalSelfAttention.forward`` with its core under ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    b, s, h = x.shape
    q, k, v = attn.c_attn(x).split(h, dim=2)
    q, k, v = (t.view(b, s, attn.n_head, h // attn.n_head).transpose(1, 2) for t in (q, k, v))
    y = checkpoint(_gpt_core, attn, q, k, v, use_reentrant=False)
    return attn.resid_dropout(attn.c_proj(y.transpose(1, 2).contiguous().view(b, s, h)))


def _llama_attention_selective(attn, x, cos, sin):
    """``LlamaAttention.forward`` with its SDPA call under ``torch.utils.checkpoint``."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from recompile_opt.models import apply_rotary

    b, s, h = x.shape
    shape = (b, s, attn.n_head, h // attn.n_head)
    q = apply_rotary(attn.wq(x).view(shape), cos, sin).transpose(1, 2)
    k = apply_rotary(attn.wk(x).view(shape), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(shape).transpose(1, 2)
    y = checkpoint(
        functools.partial(F.scaled_dot_product_attention, is_causal=True), q, k, v, use_reentrant=False
    )
    return attn.wo(y.transpose(1, 2).reshape(b, s, h))


def checkpoint_attention_cores(model) -> int:
    """Megatron's selective recompute in eager: checkpoint each attention core, nothing else.

    A module with an ``attention_core(q, k, v)`` method gets that method checkpointed; the
    attention modules of ``recompile_opt.models`` (which have none) get a copy of their
    ``forward`` that checkpoints the core.  The gradient check against eager catches a copy
    that drifted from the model.  Returns the number of modules changed."""
    import types

    from torch.utils.checkpoint import checkpoint

    from recompile_opt import models

    n = 0
    for mod in model.modules():
        core = getattr(mod, "attention_core", None)
        if callable(core):
            mod.attention_core = functools.partial(checkpoint, core, use_reentrant=False)
        elif isinstance(mod, models.CausalSelfAttention):
            mod.forward = types.MethodType(_gpt_attention_selective, mod)
        elif isinstance(mod, models.LlamaAttention):
            mod.forward = types.MethodType(_llama_attention_selective, mod)
        else:
            continue
        n += 1
    if not n:
        raise RuntimeError("eager-selective: no attention module found in the model")
    return n


def prepare(spec: dict, model, args):
    """Apply the strategy: returns the callable ``fn(idx, tgt) -> loss``."""
    import torch

    if spec.get("ckpt") == "full":
        checkpoint_blocks(model)
    elif spec.get("ckpt") == "selective":
        checkpoint_attention_cores(model)
    for mod in spec.get("needs", []):
        __import__(mod)  # fail early and clearly, e.g. "No module named 'scipy'"
    for key, value in spec.get("functorch", {}).items():
        setattr(torch._functorch.config, key, value)
    if args.dropout and not args.native_rng:
        torch._inductor.config.fallback_random = True
    if spec["kind"] == "eager":
        return model
    if spec["kind"] == "compile":
        return torch.compile(model)
    importlib.import_module("recompile_opt")  # registers the backend

    options = dict(spec["options"])
    if args.ours_compiler != "inductor":
        options["compiler"] = args.ours_compiler
    return torch.compile(model, backend="recompile_opt", options=options)
