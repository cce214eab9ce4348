#!/usr/bin/env bash
# The GPU check: one script to run on a machine with one CUDA GPU (no internet needed).
#
#   bash scripts/gpu_check.sh            # from the repository root, in under 8 minutes
#
# It finds a Python whose torch sees CUDA (the repository's .venv if it has one, else the
# system python3, in a venv that shares its packages), then runs, each under a time limit,
# going on past a failure and printing a summary at the end:
#
#   1. gpu tests      pytest -m gpu: the portable kernels on CUDA against the CPU, the
#                     trainer on CUDA against the CPU run (2 steps), resume and evaluation
#                     of a CUDA checkpoint, collectives and every sharding type on a
#                     one-rank NCCL group (one GPU holds only a one-rank NCCL group), the
#                     device cache (slots on CUDA, rows on the host) against the CPU cache
#                     and cached shards on the NCCL group (tests/unit/cache/test_cache_device.py)
#   2. train suites   tests/unit/train and tests/unit/sharding, where train.device=auto
#                     now resolves to the GPU (the CPU suites, run on CUDA)
#   3. train cuda     tetrarec train, one process, train.device=cuda, on a small config
#   4. train cpu      the same run on the CPU (its metrics printed beside the CUDA ones)
#   5. torchrun       torchrun --nproc-per-node 1 -m tetrarec train, train.device=auto: the
#                     launcher's LOCAL_RANK picks cuda:0 (a one-rank launch trains as one
#                     process; NCCL itself is exercised by step 1's one-rank group tests)
#
# Logs and JSON summaries go to $OUT (if set, as on a lent machine) or
# /tmp/tetrarec-gpu-check. Exit status: 0 if every step passed, 1 otherwise, 2 if no
# Python with CUDA torch was found.
#
# Settings (environment):
#   TETRAREC_KERNELS   default "reference": no compile of the CPU C++ kernels (a CUDA
#                      run never calls them; the CPU sides of the comparisons then run
#                      the portable oracle). Set "auto" to compile them (about a minute).
#   GPU_CHECK_VENV     where the venv goes (default /tmp/tetrarec-gpu-venv).
#   GPU_CHECK_BUDGET_S total seconds for the steps (default 420); a step that would start
#                      with under 20 s left is skipped.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOGS=${OUT:-/tmp/tetrarec-gpu-check}
mkdir -p "$LOGS"
export TETRAREC_KERNELS=${TETRAREC_KERNELS:-reference}
export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-420}

has_cuda() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

# --- a Python whose torch sees the GPU ---------------------------------------------------
PY=""
if [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
    PY=.venv/bin/python
    echo "python: the repository's .venv (its torch sees CUDA)"
else
    SYS=""
    for cand in python3 python; do
        if command -v "$cand" >/dev/null && has_cuda "$(command -v "$cand")"; then
            SYS=$(command -v "$cand")
            break
        fi
    done
    if [ -z "$SYS" ]; then
        echo "gpu_check: no python here has a torch that sees CUDA (.venv, python3, python)"
        nvidia-smi -L 2>&1 || true
        exit 2
    fi
    VENV=${GPU_CHECK_VENV:-/tmp/tetrarec-gpu-venv}
    if [ ! -x "$VENV/bin/python" ]; then
        "$SYS" -m venv --system-site-packages "$VENV"
        # --system-site-packages shares the *base* interpreter's packages; when $SYS is
        # itself a venv (where its CUDA torch lives), share its site-packages by a .pth.
        site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$SYS" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/gpu-check-parent.pth"
    fi
    if has_cuda "$VENV/bin/python"; then
        PY=$VENV/bin/python
        # Offline: the project's own files only; its dependencies come from the system.
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
            >"$LOGS/pip.log" 2>&1 || echo "editable install failed (see pip.log); using PYTHONPATH"
        echo "python: venv $VENV over $SYS"
    else
        PY=$SYS
        echo "python: $SYS (a venv over it did not see CUDA)"
    fi
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # this checkout's tetrarec, installed or not
"$PY" - <<'EOF' 2>&1 | tee "$LOGS/env.txt"
import importlib, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
print("NCCL", torch.cuda.nccl.version())
missing = [m for m in ("numpy", "pyarrow", "safetensors", "tqdm", "pytest", "tetrarec")
           if importlib.util.find_spec(m) is None]
print("missing packages:", ", ".join(missing) if missing else "none")
EOF

# --- the steps ------------------------------------------------------------------------------
NAMES=()
RESULTS=()
step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$((START + BUDGET - $(date +%s)))
    if [ "$left" -lt 20 ]; then
        NAMES+=("$name")
        RESULTS+=("SKIPPED (time budget spent)")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo
    echo "=== $name (limit ${limit}s) ==="
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 15 "$LOGS/$name.log"
    local took=$(($(date +%s) - t0))
    NAMES+=("$name")
    if [ "$rc" -eq 0 ]; then
        RESULTS+=("PASS ${took}s")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        RESULTS+=("FAIL: timed out after ${took}s")
    else
        RESULTS+=("FAIL (exit $rc) ${took}s")
    fi
}

CONFIG=examples/sharded_mixed.toml
SMALL=(--set train.steps=40 --set data.synthetic.num_samples=65536
    --set data.synthetic.eval_samples=16384 --set train.log_every=10 --set train.progress=false
    --set train.eval_every=20)

step gpu-tests 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
step train-suites 150 "$PY" -m pytest -q --maxfail=5 -p no:cacheprovider tests/unit/train \
    tests/unit/sharding
step train-cuda 90 "$PY" -m tetrarec train --config "$CONFIG" "${SMALL[@]}" \
    --set train.device=cuda --json "$LOGS/train-cuda.json"
step train-cpu 90 "$PY" -m tetrarec train --config "$CONFIG" "${SMALL[@]}" \
    --set train.device=cpu --json "$LOGS/train-cpu.json"
step torchrun-1 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m tetrarec train --config "$CONFIG" "${SMALL[@]}" --json "$LOGS/torchrun-1.json"
if ! grep -q "training on cuda:0" "$LOGS/torchrun-1.log" 2>/dev/null; then
    for i in "${!NAMES[@]}"; do
        if [ "${NAMES[$i]}" = torchrun-1 ] && [[ ${RESULTS[$i]} == PASS* ]]; then
            RESULTS[$i]="FAIL: did not train on cuda:0 (see torchrun-1.log)"
        fi
    done
fi

# --- summary ----------------------------------------------------------------------------------
echo
echo "=== summary ($(($(date +%s) - START))s; logs in $LOGS) ==="
head -n 3 "$LOGS/env.txt"
status=0
for i in "${!NAMES[@]}"; do
    printf '  %-14s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
    [[ ${RESULTS[$i]} == PASS* ]] || status=1
done
"$PY" - "$LOGS" <<'EOF'
import json, sys
from pathlib import Path
for name in ("train-cuda", "train-cpu", "torchrun-1"):
    p = Path(sys.argv[1]) / f"{name}.json"
    if p.is_file():
        s = json.loads(p.read_text())
        f = s.get("final") or {}
        print(f"  {name:14s} AUC {f.get('auc', float('nan')):.5f}  "
              f"log loss {f.get('log_loss', float('nan')):.5f}  "
              f"{s.get('samples_per_s', 0):,.0f} samples/s")
EOF
exit $status
