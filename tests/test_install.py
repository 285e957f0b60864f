"""The package works installed from its wheel, not only from the source tree (``pip install -e``).

In the source tree the graph passes live in ``passes/``; a wheel installs them as
``recompile_opt/passes/``, so a pass that finds another package's files relative to its own would look
in the wrong place once installed. The wheel is built from a copy of the sources (a stale ``build/``
in the checkout cannot leak into it) and installed into a directory of its own; a fresh interpreter
imports the package from there and compiles a model whose dropout runs through the sequence-parallel
helpers of ``recompile_opt.parallel``, whose ops the plan must attribute to the user's module.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in the fresh interpreter. The dropout runs in the model's own forward, outside every submodule, so
# its ops have no module of their own; made inside recompile_opt/parallel, the kept mask (sliced by
# collectives.copy_of_rows) and the dropout's output take the module of the value dropped out, "block".
PROBE = r"""
import json, torch, recompile_opt
from recompile_opt.passes import joint_graph
from recompile_opt.parallel.dropout import sliced_dropout

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):  # the rows 2..5 of an 8-row tensor's dropout, as the second of two ranks runs it
        return self.head(sliced_dropout(self.block(x), 0.5, True, (8, 8), ((0, 2, 4),)))

torch.manual_seed(0)
model = torch.compile(Net(), backend="recompile_opt", options={"compiler": "eager", "memory_budget": 1.0})
model(torch.randn(4, 8)).sum().backward()
(plan,) = recompile_opt.last_plans()
print(json.dumps({"package": recompile_opt.__file__, "parallel_dir": joint_graph._PARALLEL_DIR,
                  "kept": [[e.op, e.reason, e.module, e.source] for e in plan.saved]}))
"""


def _wheel(tmp_path: Path) -> Path:
    """The package's wheel, built without build isolation (no index needed) from a copy of its sources."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("recompile_opt", "passes"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("recompile_opt-*.whl")
    return wheel


def test_the_installed_wheel_plans_the_parallel_helpers_ops_in_the_users_module(tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(_wheel(tmp_path)),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    # run from tmp_path: the checkout (the interpreter's working directory) must not be on sys.path
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["package"]).resolve().is_relative_to(site.resolve())
    assert Path(out["parallel_dir"]) == Path(out["package"]).parent / "parallel"
    helpers = [k for k in out["kept"] if k[3].split(":")[0] in ("collectives.py", "dropout.py")]
    assert helpers, out["kept"]  # the sliced mask is kept, made by the helpers
    activations = [k for k in out["kept"] if k[1] not in ("input", "param")]
    assert activations and all(module == "block" for _op, _reason, module, _source in activations), out[
        "kept"
    ]


def test_no_test_module_imports_the_tests_directory_as_a_package():
    """CI runs some test files alone with the ``pytest`` entry point, which puts ``tests/`` on sys.path
    but not the checkout, so ``tests.helpers`` does not import there; ``helpers`` does. Why: such an
    import passed in full runs (another module had put the checkout on sys.path) and failed CI's torch
    2.11 run at collection (stop 83)."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name}:{node.lineno}" for name in names if name.split(".")[0] == "tests"]
    assert not offenders, f"import from helpers, not tests.helpers: {offenders}"
