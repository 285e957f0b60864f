"""Models written outside this project: torch's own ``nn.TransformerEncoder`` and
``nn.TransformerDecoder``, and a ViT with torchvision's module names (``encoder.layers.encoder_layer_0``,
its MLP an ``nn.Sequential`` whose first index is inside each layer: torchvision's own wheel does not
load beside a CPU build of torch here). Every policy and budgets 0.0 / 0.5 give eager's gradients, and
``full`` checkpoints the layers, whatever they are called."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import train_side_by_side

import recompile_opt
from recompile_opt.costs.measure import peak_memory
from recompile_opt.partitioner import MEMORY

D, HEADS, FF, SEQ, BATCH, CLASSES = 32, 2, 64, 16, 2, 10


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` (2 layers) over embedded tokens, mean-pooled, cross-entropy."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, idx, target):
        return F.cross_entropy(self.head(self.encoder(self.embed(idx)).mean(1)), target)


class DecoderLM(nn.Module):
    """``nn.TransformerDecoder`` (2 layers, causal) attending to a memory, a next-token loss."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, D)
        layer = nn.TransformerDecoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=2)
        self.head = nn.Linear(D, 64)

    def forward(self, idx, memory, target):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        out = self.decoder(self.embed(idx), memory, tgt_mask=mask, tgt_is_causal=True)
        return F.cross_entropy(self.head(out).flatten(0, 1), target.flatten())


class MLPBlock(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(D, FF), nn.GELU(), nn.Dropout(0.0), nn.Linear(FF, D), nn.Dropout(0.0))


class EncoderBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.self_attention = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = MLPBlock()

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(1, SEQ + 1, D) * 0.02)
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential()
        for i in range(layers):
            self.layers.add_module(f"encoder_layer_{i}", EncoderBlock())
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class ViT(nn.Module):
    """torchvision.models.vision_transformer.VisionTransformer's structure and module names, small:
    32x32 images in 8x8 patches (16 tokens and a class token)."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, D, kernel_size=8, stride=8)
        self.class_token = nn.Parameter(torch.zeros(1, 1, D))
        self.encoder = Encoder(layers)
        self.heads = nn.Sequential()
        self.heads.add_module("head", nn.Linear(D, CLASSES))

    def forward(self, images, target):
        x = self.conv_proj(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return F.cross_entropy(self.heads(self.encoder(x)[:, 0]), target)


class ResidualBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 conv-bn, a 1x1 conv-bn shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.downsample(x))


class ResNet(nn.Module):
    """A ResNet-18-style net in small (torchvision's names): a conv-bn-relu stem, a plain and a strided
    residual block, pooling, a 10-class head, cross-entropy, on 32x32 images."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.layer1 = ResidualBlock(width, width, 1)
        self.layer2 = ResidualBlock(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, images, target):
        h = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(images)))))
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), target)


def _resnet():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ResNet(), (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, CLASSES, (8,), generator=g))


def _encoder():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return EncoderClassifier(), (
        torch.randint(0, 64, (BATCH, SEQ), generator=g),
        torch.randint(0, CLASSES, (BATCH,), generator=g),
    )


def _decoder():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return DecoderLM(), (
        torch.randint(0, 64, (BATCH, SEQ), generator=g),
        torch.randn(BATCH, SEQ, D, generator=g),
        torch.randint(0, 64, (BATCH, SEQ), generator=g),
    )


def _vit():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ViT(), (
        torch.randn(BATCH, 3, 32, 32, generator=g),
        torch.randint(0, CLASSES, (BATCH,), generator=g),
    )


MODELS = {"encoder": _encoder, "decoder": _decoder, "vit": _vit}
CONV_MODELS = {"resnet": _resnet}  # no attention, no identical layers: the peak tests only
# each model's layers, as module paths (what `full` must checkpoint)
LAYERS = {
    "encoder": ("encoder.layers.0", "encoder.layers.1"),
    "decoder": ("decoder.layers.0", "decoder.layers.1"),
    "vit": ("encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"),
}


@pytest.mark.parametrize(
    "setting",
    [
        {"memory_budget": 0.0},
        {"memory_budget": 0.5},
        {"policy": "full"},
        {"policy": "megatron-selective"},
        {"policy": "save-all"},
    ],
    ids=str,
)
@pytest.mark.parametrize("name", MODELS)
def test_gradients_equal_eager(name, setting):
    model, inputs = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "no blocks found" or infeasible-budget warning
        train_side_by_side(model, inputs, options={**setting, "compiler": "eager"}, steps=2)


@pytest.mark.parametrize("name", MODELS)
def test_full_checkpoints_each_layer_and_keeps_only_what_crosses_them(name):
    """Inside every layer something is recomputed, and nothing inside a layer is kept but what leaves
    it; torchvision's naming used to make each MLP linear a "block", so nothing was recomputed."""
    model, inputs = MODELS[name]()
    plan = recompile_opt.plan(model, inputs, policy="full")
    inside = [e for e in plan.recomputed if e.module.startswith(LAYERS[name])]
    for layer in LAYERS[name]:
        assert any(e.module.startswith(layer + ".") for e in inside), (layer, plan)
    save_all = recompile_opt.plan(model, inputs, policy="save-all")
    assert plan.saved_bytes < 0.6 * save_all.saved_bytes, (plan.summary(), save_all.summary())


@pytest.mark.parametrize("name", MODELS)
def test_megatron_selective_recomputes_the_attention_call_and_nothing_outside_attention(name):
    model, inputs = MODELS[name]()
    plan = recompile_opt.plan(model, inputs, policy="megatron-selective")
    flops = [e for e in plan.recomputed if e.flops]
    assert flops and all("attention" in e.op or "attn" in e.module for e in flops), plan


class DictStack(nn.Module):
    """Layers in an ``nn.ModuleDict`` under names with no index at all."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"first": EncoderBlock(), "second": EncoderBlock()})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x.square().mean()


class Bare(nn.Module):
    """No submodules: nothing to call a block."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        return (x @ self.w).tanh().square().mean()


def test_full_finds_layers_named_without_an_index():
    torch.manual_seed(0)
    plan = recompile_opt.plan(DictStack(), (torch.randn(BATCH, SEQ, D),), policy="full")
    for layer in ("layers.first.", "layers.second."):
        assert any(e.module.startswith(layer) for e in plan.recomputed), (layer, plan)


def test_full_says_when_it_finds_no_blocks():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="policy='full': no repeated blocks found"):
        plan = recompile_opt.plan(Bare(), (torch.randn(BATCH, D),), policy="full")
    assert any("no repeated blocks found" in n for n in plan.notes) and not plan.recompute_flops


def _predicted_and_measured(name, setting, with_source=False):
    """The plan's predicted peak and the measured peak of a step compiled by Inductor (one more step
    after one of training, entered with gradients None as the prediction assumes); with
    ``with_source``, also where the prediction came from (bench/outside_peaks.py prints it)."""
    model, inputs = {**MODELS, **CONV_MODELS}[name]()
    torch._dynamo.reset()
    plan, measured = train_side_by_side(model, inputs, options=setting, steps=1, measure_peak=True)
    if with_source:
        return plan.predicted_peak_bytes, measured, plan.solver.get("peak_from")
    return plan.predicted_peak_bytes, measured


def test_a_vision_models_peak_counts_its_convolution_scratch_and_channels_last_copies():
    """Inductor copies the ViT's images and patch weights channels-last and keeps the copies for the
    backward, and the convolution's backward allocates twice its weight gradient inside the op: the
    prediction was 37% under the measured peak without either. (The plan now walks the plain layout
    too and takes it: the prediction is the walk of the layout compiled.)"""
    predicted, measured = _predicted_and_measured("vit", {"memory_budget": 0.0})
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)


def _measured_peak(model, inputs, backend: str | None) -> int:
    """One step's measured peak after a warm-up step: eager (``backend`` None) or plain ``torch.compile``."""
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    fn = model if backend is None else torch.compile(model, backend=backend)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        fn(*inputs).backward()
    model.zero_grad(set_to_none=True)
    return peak_memory(lambda: fn(*inputs).backward())


@pytest.mark.slow
def test_a_vision_transformers_least_peak_is_at_most_eagers_and_plain_compiles():
    """Inductor lays the ViT's patch convolution out channels-last and keeps the copies of its images and
    weights for the backward: every plan measured 203,824 B, plain torch.compile too, against eager's
    133,332 (131,020 on one thread). The plan walks both layouts and keeps the convolution's own where
    it peaks lower. The 0.0 plan had taken a plan 3.5% above the least walked peak for 2.7% of the
    step's time (then the search's tie: 5% of peak for any saving): 132,080 B on one thread, over eager.
    A peak is now traded for at least as large a share of the step."""
    model, inputs = _vit()
    eager, compiled = _measured_peak(model, inputs, None), _measured_peak(model, inputs, "inductor")
    predicted, measured = _predicted_and_measured("vit", {"memory_budget": 0.0})
    assert measured <= compiled and measured <= eager, (measured, eager, compiled)
    assert predicted == pytest.approx(measured, rel=0.01), (predicted, measured)
    assert any("convolutions in their own layout" in n for n in recompile_opt.last_plans()[-1].notes)


def test_a_search_walked_in_another_layout_is_searched_again():
    """The eager compiler's search walks a ViT's convolutions channels-last; Inductor's compile walks them
    in their own layout. Its compile had taken the eager search's ends (the tests ran in that order):
    its 0.0 plan peaked 3.5% above the least (132,080 B against 127,580 measured, one thread)."""
    model, inputs = _vit()
    fresh = recompile_opt.plan(model, inputs, memory_budget=0.0)
    MEMORY.range_ends.clear()
    recompile_opt.plan(model, inputs, memory_budget=0.0, compiler="eager")
    again = recompile_opt.plan(model, inputs, memory_budget=0.0)
    assert again.predicted_peak_bytes == fresh.predicted_peak_bytes, (again, fresh)


def test_under_the_eager_compiler_a_vision_models_plans_are_walked_in_the_layout_inductor_takes():
    """``compiler="eager"`` plans the graph Inductor would, so its walked figures are the ones Inductor's
    compile gets. The ViT's were walked with the convolutions channels-last (Inductor's default, which
    its compile switches off there): every plan walked 514,092 B at 0.0, 0.5 and under ``full`` (a
    Hugging Face ViT: 502.04 KiB against the 373.54 Inductor's compile gets and measures)."""
    model, inputs = _vit()
    for setting in ({"memory_budget": 0.0}, {"memory_budget": 0.5}):
        compiled = recompile_opt.plan(model, inputs, **setting)
        eager = recompile_opt.plan(model, inputs, **setting, compiler="eager")
        assert eager.solver["peak_from"] == compiled.solver["peak_from"] == "inductor-code", eager.notes
        assert eager.predicted_peak_bytes == compiled.predicted_peak_bytes, (setting, eager, compiled)
        assert any("convolutions in their own layout" in n for n in eager.notes), eager.notes


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        {"memory_budget": 0.0},
        {"memory_budget": 0.5},
        {"policy": "full"},
        {"policy": "megatron-selective"},
        {"policy": "save-all"},
    ],
    ids=str,
)
@pytest.mark.parametrize("name", MODELS)
def test_predicted_peak_is_within_10_percent_of_the_measured_step(name, setting):
    predicted, measured = _predicted_and_measured(name, setting)
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
