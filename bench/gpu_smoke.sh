#!/usr/bin/env bash
# The one GPU call (bench/gpu_smoke.py says what it runs) on a bare GPU machine: its environment, then
# every section, each ending with one JSON line; exit 1 when a section failed.
#
#   bash bench/gpu_smoke.sh                 # on the GPU machine (about 8 minutes)
#   bash bench/gpu_smoke.sh --cpu-check     # anywhere: every section's code at toy sizes on the CPU
#
# Carry .whl (pycocotools wheels: the GPU image lacks it), vendor_local/apex-25.04-python.tar.gz (the
# Apex sections), checkpoints/_synthetic (saves drawing it) and .bench_data/coco80 (the evaluation
# section's real pictures; else coco4 repeated). Before the first call, on the development machine:
#   printf '/.whl/\n/.bench_data/\n' >> .git/info/exclude
#   for version in 3.10 3.11 3.12 3.13; do
#       python3 -m pip download --isolated --no-deps --only-binary=:all: --python-version $version \
#           --implementation cp --platform manylinux2014_x86_64 -d .whl pycocotools; done
#   mkdir -p vendor_local && cp ../shared/vendor/apex-25.04-python.tar.gz vendor_local/
# The sections' logs come back as $OUT/smoke_logs.tgz, their JSON lines as $OUT/sections.jsonl.
set -u -o pipefail
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ! "$python" -c "import pycocotools" 2>/dev/null; then    # the wheel of this python
    pytag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    wheel=$(ls .whl/pycocotools-*-"$pytag"-*.whl 2>/dev/null | head -n 1)
    if [ -n "$wheel" ]; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" \
            && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no pycocotools wheel for $pytag in .whl/: see the header of bench/gpu_smoke.sh" >&2
    fi
fi
if [ -f vendor_local/apex-25.04-python.tar.gz ]; then   # Apex's Python package, outside tracked files
    mkdir -p vendor_local/apex-25.04 && tar xzf vendor_local/apex-25.04-python.tar.gz -C vendor_local/apex-25.04
    export PYTHONPATH="$PWD/vendor_local/apex-25.04${PYTHONPATH:+:$PYTHONPATH}"
fi
out=${OUT:-bench_out}
"$python" "$(dirname "$0")/gpu_smoke.py" "$@"
status=$?
if [ -d "$out/smoke" ]; then
    cp "$out/smoke/sections.jsonl" "$out/" 2>/dev/null
    tar czf "$out/smoke_logs.tgz" -C "$out" smoke && rm -rf "$out/smoke"
fi
exit $status
