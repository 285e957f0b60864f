#!/usr/bin/env bash
# Fill wheels/ (git-ignored) with what the GPU machine's image lacks, for CPython 3.12 manylinux x86_64:
# PuLP, highspy (the ILP's solver) and a wheel of recompile_opt built from this tree. Run here, where
# PyPI is reachable; the GPU machine has no network (bench/gpu_install.sh installs from wheels/).
# Fails when wheels/ exceeds 64 MiB (what a device run may carry beside the working tree).
#
#   bench/fetch_wheels.sh            # then: run(carry=["wheels"], "bash bench/gpu_install.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT_MIB=64
rm -rf wheels && mkdir -p wheels
python -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --no-deps -d wheels 'pulp>=3.3,<4' 'highspy>=1.7,<1.16'
python -m pip wheel --no-deps --no-build-isolation . -w wheels
ls -l wheels
size_kib=$(du -sk wheels | cut -f1)
echo "wheels/: $((size_kib / 1024)) MiB (${size_kib} KiB)"
if (( size_kib > LIMIT_MIB * 1024 )); then
    echo "wheels/ is over ${LIMIT_MIB} MiB" >&2
    exit 1
fi
