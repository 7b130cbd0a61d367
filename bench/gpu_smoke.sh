#!/usr/bin/env bash
# The one GPU call (bench/gpu_smoke.py says what it runs): the GPU machine's environment, then every
# section, each ending with one JSON line; exit 1 when a section failed.
#
#   bash bench/gpu_smoke.sh                 # on the GPU machine (about 8 minutes)
#   bash bench/gpu_smoke.sh --cpu-check     # anywhere: every section's code at toy sizes on the CPU
#
# Carry what bench/gpu_env.sh reads: .whl (a pycocotools wheel for the machine's python3),
# vendor_local/apex-25.04-python.tar.gz (the Apex sections), checkpoints/_synthetic (saves drawing
# it) and .bench_data/coco80 (the evaluation section's real pictures; else coco4 repeated). The
# sections' logs come back as $OUT/smoke_logs.tgz, their JSON lines as $OUT/sections.jsonl.
set -u -o pipefail
source "$(dirname "$0")/gpu_env.sh"
out=${OUT:-bench_out}
python3 "$(dirname "$0")/gpu_smoke.py" "$@"
status=$?
if [ -d "$out/smoke" ]; then
    cp "$out/smoke/sections.jsonl" "$out/" 2>/dev/null
    tar czf "$out/smoke_logs.tgz" -C "$out" smoke && rm -rf "$out/smoke"
fi
exit $status
