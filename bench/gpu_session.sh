#!/usr/bin/env bash
# The GPU check of one session's lease (15 minutes of device time, its start included) in one call of
# about 9 minutes, in three runs of bench/gpu_check.py and one of bench/chunk_rows.py, each with a
# deadline so that each writes its report whatever hangs, each result streamed to JSON lines as it lands:
#   1. performance and the chunked plan's profile (what issues 45 and 51 measure);
#   2. the chunked loss's two bodies, ATen's and Inductor's fused one, timed alone (bench/chunk_rows.py);
#   3. offload (issue 50), alone: its cases once outran 320 s (ours-peak+offload) and once lost the loss
#      to NaN (ours-0.5+offload, before each copy's wait held its buffer and moved to where the copy ends);
#   4. correctness and fidelity: the demo GPT again (its predicted peaks now the CUDA allocator's blocks,
#      the code's requests measured apart: on 2026-12-04 five of its 16 plans missed 3%), and the models
#      not yet run there (Llama, the Hugging Face Llama), at six options each.
# Here, first: bench/fetch_wheels.sh. Then: run(carry=["wheels"], command="bash bench/gpu_session.sh",
# timeout_s=590). What comes back under $OUT: gpu_*.md, *.jsonl and *.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python

check() {  # NAME DEADLINE_S ARGS...: one run of the check, its report, results and log under $OUT
    local name=$1 deadline=$2
    shift 2
    timeout $((deadline + 30)) python bench/gpu_check.py "$@" --deadline "$deadline" --timeout "$deadline" \
        --results "$OUT/$name.jsonl" --out "$OUT/gpu_$name.md" --verbose >"$OUT/$name.log" 2>&1
}

bash bench/gpu_install.sh --install-only >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
check perf 240 --parts performance,profile --jobs 7 --ckpt-peak-mib 2320.6 \
    --strategies compile,compile-ckpt,ours-none,ours-0.0,ours-peak --profiles ours-0.0+chunks
timeout 65 python bench/chunk_rows.py --ms >"$OUT/chunk_rows.md" 2>"$OUT/chunk_rows.log" \
    || echo "chunk_rows.py: exit $? (124: timed out after 65 s)" >>"$OUT/chunk_rows.log"
check offload 120 --parts performance --jobs 2 --ckpt-peak-mib 2320.6 \
    --strategies ours-0.5+offload,ours-peak+offload
check numeric 110 --parts correctness,fidelity --jobs 12 --models gpt,llama,hf-llama \
    --options 0.0,0.5,bytes,peak,full,chunks
grep -h "gpu_check\]" "$OUT"/*.log
