"""Shared fixtures: a fresh Dynamo cache per test (so every test really compiles), quiet Inductor."""

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

import recompile_opt


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    recompile_opt.reset_plans()
    yield
    torch._dynamo.reset()
