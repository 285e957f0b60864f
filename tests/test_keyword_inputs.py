"""Keyword inputs (issue 46): Hugging Face models are called with keywords, so ``recompile_opt.plan``
takes a dict of them (``plan(model, {"input_ids": ids, "labels": ids})``, a tokenizer's
``BatchEncoding`` too) or ``kwargs=`` beside positional inputs, and a ``recompile-opt plan`` factory may
return one. Each plan equals the plan of the same tensors passed positionally to a wrapper."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from test_hf_models import BATCH, SEQ, VOCAB, llama

import recompile_opt
from recompile_opt.cli import main
from recompile_opt.plan import Plan

transformers = pytest.importorskip("transformers")


def tiny_llama_keywords():
    """A factory for ``recompile-opt plan``: an HF Llama and its keyword inputs."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return llama().train(), {"input_ids": ids, "labels": ids}


class Positional(torch.nn.Module):
    """``forward(input_ids, labels)`` -> the model's output object, as the model called with keywords."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels)


def _decisions(plan: Plan, prefix: str = "") -> list[tuple]:
    """What a plan decides, value by value, with module paths less ``prefix`` (the wrapper's)."""

    def module(path):
        return "" if path + "." == prefix else path.removeprefix(prefix)

    return sorted(
        (e.op, tuple(e.shape), e.action, e.reason, e.bytes, module(e.module))
        for e in plan.saved + plan.recomputed
    )


@pytest.fixture(scope="module")
def positional():
    """What the plan of the same model and tensors, called positionally through a wrapper, decides."""
    model, kw = tiny_llama_keywords()
    plan = recompile_opt.plan(Positional(model), (kw["input_ids"], kw["labels"]), compiler="eager")
    return plan, _decisions(plan, "model.")


def test_a_dict_of_keyword_inputs_plans_as_positional_inputs_do(positional):
    expected, decisions = positional
    model, kw = tiny_llama_keywords()
    plan = recompile_opt.plan(model, kw, compiler="eager")
    assert (plan.saved_bytes, plan.baseline_bytes, plan.recompute_flops) == (
        expected.saved_bytes,
        expected.baseline_bytes,
        expected.recompute_flops,
    ), plan.summary()
    assert _decisions(plan) == decisions  # module paths as the model names them (not "0.model.layers.0")
    # a tokenizer's BatchEncoding is a Mapping, not a dict; kwargs= goes beside positional inputs
    encoding = collections.UserDict(kw)
    for again in (
        recompile_opt.plan(model, encoding, compiler="eager"),
        recompile_opt.plan(model, (kw["input_ids"],), kwargs={"labels": kw["labels"]}, compiler="eager"),
    ):
        assert _decisions(again) == decisions, again.summary()


def test_a_factory_returning_keyword_inputs_plans_from_the_shell(positional, tmp_path, capsys):
    path = tmp_path / "plan.json"
    main(["plan", "test_keyword_inputs:tiny_llama_keywords", "--json", str(path)])
    plan = Plan.from_json(path.read_text())
    assert "policy=auto" in capsys.readouterr().out
    assert _decisions(plan) == positional[1], json.dumps(plan.to_dict())[:2000]


def test_frontier_says_it_takes_positional_inputs_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["frontier", "test_keyword_inputs:tiny_llama_keywords", "--no-pytorch"])
    assert exit_.value.code == 2
    assert "returns keyword inputs" in capsys.readouterr().err
