"""The supported torch range, checked when recompile_opt is imported (``_torch_internals``)."""

import subprocess
import sys

import pytest
import torch

from recompile_opt import _torch_internals as ti


@pytest.mark.parametrize(
    "version", ["2.10.2", "2.10.0+cpu", "2.16.0", "2.16.0a0+git1234abc", "3.0.0", "1.13.1"]
)
def test_an_unsupported_torch_is_refused_by_name_and_range(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(ImportError) as info:
        ti.check_torch_version()
    message = str(info.value)
    assert "2.11 <= torch < 2.16" in message
    assert f"torch {version} is installed" in message


@pytest.mark.parametrize(
    "version, parsed",
    [
        ("2.11.0", (2, 11, 0)),
        ("2.12.1+cpu", (2, 12, 1)),
        ("2.13.0", (2, 13, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.14.1+cu130", (2, 14, 1)),
        ("2.15.0", (2, 15, 0)),
        ("2.15.2rc1", (2, 15, 2)),
    ],
)
def test_a_supported_torch_passes(monkeypatch, version, parsed):
    monkeypatch.setattr(torch, "__version__", version)
    assert ti.check_torch_version() == parsed


def test_the_installed_torch_is_the_one_recorded():
    assert ti.TORCH_VERSION == ti.parse_torch_version(torch.__version__)


def test_importing_recompile_opt_runs_the_check():
    """In a fresh interpreter: ``import recompile_opt`` (nothing else from the package first) fails with
    the range's message under a torch that reports 2.16."""
    code = "import torch; torch.__version__ = '2.16.0'; import recompile_opt"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert (
        "ImportError: recompile_opt supports 2.11 <= torch < 2.16; torch 2.16.0 is installed" in proc.stderr
    )
