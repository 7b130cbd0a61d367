# Sourced by bench/gpu_checks.sh and bench/gpu_smoke.sh: the environment of a bare GPU machine.
# pycocotools from the wheels carried in .whl/ (one per Python 3.10-3.13, see gpu_checks.sh's
# header): the one of this python3 is installed outside the repository, when it does not import.
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ! python3 -c "import pycocotools" 2>/dev/null; then
    pytag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    wheel=$(ls .whl/pycocotools-*-"$pytag"-*.whl 2>/dev/null | head -n 1)
    if [ -n "$wheel" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" \
            && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no pycocotools wheel for $pytag in .whl/: see the header of bench/gpu_checks.sh" >&2
    fi
fi
if [ -f vendor_local/apex-25.04-python.tar.gz ]; then   # Apex's Python package, outside tracked files
    mkdir -p vendor_local/apex-25.04 && tar xzf vendor_local/apex-25.04-python.tar.gz -C vendor_local/apex-25.04
    export PYTHONPATH="$PWD/vendor_local/apex-25.04${PYTHONPATH:+:$PYTHONPATH}"
fi
