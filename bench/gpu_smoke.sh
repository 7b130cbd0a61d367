#!/usr/bin/env bash
# Every CUDA path of the trainer once, in one command (tiny preset, the project's synthetic
# dataset, a few steps each), ending with one table: each path, ok or its first error line,
# seconds, images/s. On one H100 (2026-11-26) the first 11 rows took 490 s, each process spending
# about 15 s on its first CUDA step: split a run that must fit in less with SMOKE_ONLY.
#
#   bash bench/gpu_smoke.sh              # on the GPU machine
#   bash bench/gpu_smoke.sh --cpu-check  # anywhere: each stage's command lines are checked against
#                                        # their scripts' parsers (bench/check_args.py, nothing
#                                        # trains); the stages are reported "skipped: no CUDA"
#   SMOKE_ONLY='^(O0|evaluate)' bash bench/gpu_smoke.sh   # only the rows whose path matches
#
# Carry what bench/gpu_checks.sh's header says: .whl (pycocotools wheels for Python 3.10-3.13)
# and, for the Apex rows, vendor_local/apex-25.04-python.tar.gz. Logs: $OUT/smoke/STAGE.log (or
# bench_out/smoke/); the table also goes to $OUT/smoke/table.txt.
set -u -o pipefail
mode=${1:-run}
case "$mode" in run|--cpu-check) ;; *) echo "usage: bash bench/gpu_smoke.sh [--cpu-check]"; exit 2 ;; esac
out=${OUT:-bench_out}/smoke
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
runs=$(mktemp -d)
synthetic=checkpoints/_synthetic
quick=(--config tiny --epochs 2 --set train.max_steps_per_epoch=4 --ap-every 2 --set train.ap_max_images=8
       --set train.tensorboard=false --device cuda --out-dir "$runs")
resume=(--resume auto --epochs 3 --device cuda --out-dir "$runs")
table=()

cuda_ok() { [ "$mode" = run ] && python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; }
apex_ok() { python3 -c "import apex.amp, apex.parallel" >/dev/null 2>&1; }

# run COMMAND...: run it (its output to the stage's log), or under --cpu-check only parse it
run() {
    if [ "$mode" = run ]; then
        "$@" >>"$log" 2>&1
    else
        python3 bench/check_args.py "$@" >>"$log" 2>&1
    fi
}

first_error() {   # the first line of the log that names an error, else its last line
    grep -m1 -E '^(error:|[A-Za-z_.]*(Error|Exception)\b|RuntimeError|Traceback)' "$1" \
        || tail -n 1 "$1"
}

images_per_s() {  # the last logged training rate of run NAME, or -
    python3 - "$runs/$1/metrics.jsonl" <<'PY' 2>/dev/null || echo -
import json, sys
rates = [r["samples_per_s"] for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "train"]
print(f"{rates[-1]:.1f}" if rates else "-")
PY
}

# stage NAME RUN_NAME FUNCTION: one row of the table
stage() {
    local name=$1 run_name=$2 body=$3 start result seconds rate
    [[ "$name" =~ ${SMOKE_ONLY:-.} ]] || return 0
    log="$out/$(printf %s "$name" | tr -c 'A-Za-z0-9._-' _).log"   # names the device tool returns
    : >"$log"
    start=$(date +%s.%N)
    if $body; then
        result=ok
        if [ "$mode" != run ]; then
            result="skipped: no CUDA (command lines accepted)"
        fi
    else
        result=$(first_error "$log" | cut -c1-110)
        [ "$mode" != run ] && result="command line refused: $result"
    fi
    seconds=$(python3 -c "import time; print(f'{time.time() - $start:.0f}')")
    rate=-
    [ "$mode" = run ] && [ -n "$run_name" ] && rate=$(images_per_s "$run_name")
    table+=("$(printf '%-28s %6s %9s  %s' "$name" "$seconds" "$rate" "$result")")
    echo "${table[-1]}"
}

level() {         # train, resume and AP at one opt level: level RUN_NAME OPTIONS...
    local name=$1; shift
    run python3 train.py "$@" --run-name "$name" "${quick[@]}" \
        && run python3 train.py "${resume[@]}" --run-name "$name"
}
o0()        { level o0 --opt-level O0; }
o1_fp16()   { level o1fp16 --opt-level O1 --amp-dtype float16; }
o1_bf16()   { level o1bf16 --opt-level O1 --amp-dtype bfloat16; }
o2()        { level o2 --opt-level O2; }
o3()        { level o3 --opt-level O3 --optimizer sgd; }   # AdamW is refused in float16 O3
feed()      { run python3 train.py --opt-level O1 --workers 2 --accumulate 2 --run-name feed "${quick[@]}"; }
parallel()  { run python3 train_parallel.py --opt-level O1 --run-name dp "${quick[@]}"; }
group1()    {
    run torchrun --standalone --nproc_per_node 1 bench/group_of_one.py --opt-level O1 --sync-bn \
        --force-sync-function --zero --run-name g1 "${quick[@]}"
}
evaluate()  {
    run python3 evaluate.py --weights "$runs/o1fp16/last.pth" --h5 "$synthetic/val.h5" --max-images 8 \
        --device cuda --no-progress
}
export_onnx() {
    run python3 export.py --weights "$runs/o1fp16/last.pth" --format onnx --out "$runs/pose.onnx" || return 1
    if [ "$mode" = run ] && python3 -c "import onnxruntime" 2>/dev/null; then
        python3 - "$runs/pose.onnx" >>"$log" 2>&1 <<'PY'
import sys
import numpy as np
import onnxruntime as ort
if "CUDAExecutionProvider" not in ort.get_available_providers():
    print("onnxruntime has no CUDAExecutionProvider here: checked on the CPU by export.py only")
    sys.exit(0)
session = ort.InferenceSession(sys.argv[1], providers=["CUDAExecutionProvider"])
name = session.get_inputs()[0].name
out = session.run(None, {name: np.zeros((1, 3, 256, 256), np.float32)})
print("onnxruntime CUDAExecutionProvider ran it:", [o.shape for o in out])
PY
    fi
}
apex_o1() { run python3 train.py --amp-backend apex --opt-level O1 --run-name apex1 "${quick[@]}"; }
apex_o2() { run python3 train.py --amp-backend apex --opt-level O2 --run-name apex2 "${quick[@]}"; }

if [ "$mode" = run ] && ! cuda_ok; then
    echo "no CUDA GPU here: use bash bench/gpu_smoke.sh --cpu-check"; exit 2
fi
{
if [ "$mode" = run ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
printf '%-28s %6s %9s  %s\n' path seconds images/s result
stage "O0 train+resume+AP" o0 o0
stage "O1 fp16 train+resume+AP" o1fp16 o1_fp16
stage "O1 bf16 train+resume+AP" o1bf16 o1_bf16
stage "O2 train+resume+AP" o2 o2
stage "O3 train+resume+AP" o3 o3
stage "device feed, 2 workers" feed feed
stage "train_parallel.py" dp parallel   # one GPU: DataParallel wraps from two
stage "torchrun NCCL group of 1" g1 group1
stage "evaluate.py" "" evaluate
stage "export.py + onnxruntime" "" export_onnx
if apex_ok || [ "$mode" != run ]; then
    stage "apex O1" apex1 apex_o1
    stage "apex O2" apex2 apex_o2
else
    table+=("$(printf '%-28s %6s %9s  %s' "apex O1 / O2" - - "skipped: Apex does not import")")
fi
echo
printf '%-28s %6s %9s  %s\n' path seconds images/s result | tee "$out/table.txt"
printf '%s\n' "${table[@]}" | tee -a "$out/table.txt"
} 2>&1 | tee "$out/run.log"
# exit 1 when a row is neither ok nor skipped (the result starts at column 48)
tail -n +2 "$out/table.txt" | cut -c48- | grep -q -v -E '^(ok|skipped)' && exit 1
exit 0
