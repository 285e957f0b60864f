#!/usr/bin/env bash
# On the GPU machine, from the repository root, with no network: install PuLP, highspy and recompile_opt
# beside the image's own torch, Triton and transformers (never reinstalled: --no-deps), then run the
# check. wheels/ comes from bench/fetch_wheels.sh, carried with the working tree.
#
#   bash bench/gpu_install.sh [gpu_check.py's flags ...]
#   bash bench/gpu_install.sh --install-only
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_BREAK_SYSTEM_PACKAGES=1  # an image's system Python (PEP 668) takes these three packages too
python -m pip install --no-index --find-links wheels --no-deps 'pulp>=3.3,<4' 'highspy>=1.7,<1.16'
# the working tree itself when setuptools can build it here; else the wheel built from it beside PyPI
if python -c "import setuptools, sys; sys.exit(int(tuple(map(int, setuptools.__version__.split('.')[:2])) < (68, 0)))"; then
    python -m pip install --no-index --no-deps --no-build-isolation .
else
    echo "setuptools >= 68 missing: installing the prebuilt wheel from wheels/" >&2
    python -m pip install --no-index --no-deps --find-links wheels recompile_opt
fi
(cd /tmp && python -c "import torch, recompile_opt; print('torch', torch.__version__, '| recompile_opt from', recompile_opt.__file__)") \
    || echo "recompile_opt does not import here; bench/gpu_check.py writes why into its header" >&2
[ "${1:-}" = --install-only ] && exit 0
exec python bench/gpu_check.py "$@"
