#!/usr/bin/env bash
# The GPU-only checks and figures, in stages that each fit one 10-minute device call.
#
#   bash bench/gpu_checks.sh cuda        # CUDA paths end to end: O1 fp16 / O1 bf16 / O2 / O3 train,
#                                        # resume and AP; fp16 with --accumulate 2;
#                                        # train_parallel.py and torchrun on the one GPU
#                                        # (a 1-process torchrun creates no process group: see group1)
#   bash bench/gpu_checks.sh group1      # a real NCCL process group of one rank (bench/group_of_one.py):
#                                        # DDP, ZeRO, CUDA SyncBN (forced through its distributed
#                                        # function) and NCCL collectives built and run
#   bash bench/gpu_checks.sh synthetic   # bench/train_throughput.py, all configs, channels_last off/on
#   bash bench/gpu_checks.sh compile_fp16       # O1 fp16 under torch.compile, channels_last on
#   bash bench/gpu_checks.sh compile_bf16       # O1 bf16 under torch.compile, channels_last on
#   bash bench/gpu_checks.sh compile_fp16_nchw  # O1 fp16 under torch.compile, channels_last off
#                                        # (one cold compile each, about 330 s: one call each)
#   bash bench/gpu_checks.sh loader      # O1 fed by the engine's DataLoader from coco4 x64, workers = cores
#   bash bench/gpu_checks.sh apex        # does Apex 25.04 import and patch this torch; O1/O2
#                                        # loss curves, images/s and memory of both backends
#                                        # (bench/apex_compare.py)
#   bash bench/gpu_checks.sh apex_runs   # apex DDP + convert_syncbn_model in a 1-rank NCCL group; resume
#                                        # across backends (bench/cross_backend_resume.py); accumulation
#   bash bench/gpu_checks.sh apex_speed  # bench/train_throughput.py, native against apex, batch 16
#
# The apex stages need the vendored Apex in the git-ignored vendor_local/, named in the call's carry:
#   mkdir -p vendor_local && cp ../shared/vendor/apex-25.04-python.tar.gz vendor_local/
#
# Logs go to $OUT/STAGE.log (or bench_out/). The GPU image lacks pycocotools, and coco4 lives
# outside the repository, so before the first call, on the development machine:
#   printf '/.whl/\n/.bench_data/\n' >> .git/info/exclude
#   for version in 3.10 3.11 3.12 3.13; do
#       python3 -m pip download --isolated --no-deps --only-binary=:all: --python-version $version \
#           --implementation cp --platform manylinux2014_x86_64 -d .whl pycocotools; done
#   mkdir -p .bench_data && cp -r ../shared/data/coco4 .bench_data/
# and name `.whl` and `.bench_data` in the call's carry (bench/gpu_env.sh installs the wheel of
# the machine's python3).
set -u -o pipefail
stage=${1:?usage: bash bench/gpu_checks.sh cuda|group1|synthetic|compile_fp16|compile_bf16|compile_fp16_nchw|loader|apex|apex_runs|apex_speed}
out=${OUT:-bench_out}
mkdir -p "$out"
log="$out/$stage.log"
export SIMPLEPOSE_COCO4=${SIMPLEPOSE_COCO4:-.bench_data/coco4}
source "$(dirname "$0")/gpu_env.sh"
runs=$(mktemp -d)
case "$stage" in apex*)
    [ -f vendor_local/apex-25.04-python.tar.gz ] || {
        echo "no vendor_local/apex-25.04-python.tar.gz: see the header of bench/gpu_checks.sh"; exit 2; }
    ;;
esac
device=${DEVICE:-cuda}     # DEVICE=cpu runs the cuda stage's commands on a CPU, to check the script
quick=(--epochs 2 --set train.max_steps_per_epoch=4 --ap-every 2 --set train.ap_max_images=8
       --out-dir "$runs" --device "$device")

{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
nproc
case "$stage" in
cuda)
    set -e
    for level in "O1 --amp-dtype float16" "O1 --amp-dtype bfloat16" "O2" "O3 --optimizer sgd"; do
        name=run-$(echo "$level" | tr -d " -")
        python3 train.py --opt-level $level --run-name "$name" "${quick[@]}"
        python3 train.py --resume auto --run-name "$name" --epochs 3 --out-dir "$runs" --device "$device"
    done
    python3 train.py --opt-level O1 --amp-dtype float16 --accumulate 2 --run-name acc "${quick[@]}"
    python3 train_parallel.py --opt-level O1 --run-name dp "${quick[@]}"
    torchrun --standalone --nproc_per_node 1 train_distributed.py --opt-level O1 --sync-bn \
        --run-name ddp "${quick[@]}"
    python3 evaluate.py --weights "$runs/ddp/last.pth" --h5 checkpoints/_synthetic/val.h5 \
        --max-images 8 --device "$device" --no-progress
    ;;
group1)
    set -e
    python3 bench/group_of_one.py --opt-level O1 --sync-bn --force-sync-function --zero --accumulate 2 \
        --run-name g1 "${quick[@]}"
    python3 bench/group_of_one.py --opt-level O1 --sync-bn --force-sync-function --delay-allreduce \
        --run-name g1 --resume auto --epochs 3 --out-dir "$runs" --device "$device"
    ;;
synthetic)
    python3 bench/train_throughput.py --batch 16
    ;;
compile_fp16|compile_bf16|compile_fp16_nchw)
    # one cold compile per call; the first step of the row is mostly compilation
    config="O1 fp16"; layout=on
    [ "$stage" = compile_bf16 ] && config="O1 bf16"
    [ "$stage" = compile_fp16_nchw ] && layout=off
    python3 bench/train_throughput.py --batch 16 --configs "$config" --channels-last $layout --compile on \
        "${@:2}"
    ;;
loader)
    python3 bench/train_throughput.py --batch 16 --configs "O1 fp16" "O1 bf16" --channels-last on --h5 coco4
    ;;
apex)
    sha256sum vendor_local/apex-25.04-python.tar.gz
    # point 2's finding: does Apex 25.04 import and patch this torch? (the exact failure, if any)
    python3 -c "import apex, torch; from apex import amp; from apex.parallel import DistributedDataParallel, convert_syncbn_model; print('apex at', apex.__path__[0], 'imports with torch', torch.__version__)"
    python3 -c "from engine.precision.apex_checks import missing_torch_apis as m; print('torch APIs Apex 25.04 needs and this torch lacks:', m() or 'none')"
    # point 4: the loss curves (tolerance: see bench/apex_compare.py), images/s and memory
    python3 bench/apex_compare.py --preset imhn512 --input 512 --batch 8 --steps 60 --levels O1 O2
    ;;
apex_runs)
    # apex.parallel.DistributedDataParallel + convert_syncbn_model in a real 1-rank NCCL group, with
    # accumulation (its no_sync) and then --delay-allreduce on resume
    set -e
    python3 bench/group_of_one.py --amp-backend apex --opt-level O1 --sync-bn --accumulate 2 --run-name ga \
        "${quick[@]}"
    python3 bench/group_of_one.py --amp-backend apex --opt-level O2 --sync-bn --delay-allreduce --run-name ga \
        --resume auto --epochs 3 --out-dir "$runs" --device "$device"
    # point 3: a checkpoint of each backend resumes in the other with identical weights and loss
    # scale (bench/cross_backend_resume.py compares, bit for bit), then trains on
    python3 train.py --amp-backend apex --opt-level O2 --freeze stem --run-name a2n "${quick[@]}"
    python3 bench/cross_backend_resume.py --resume "$runs/a2n/last.pth" --amp-backend native --device "$device"
    python3 train.py --amp-backend native --resume auto --run-name a2n --epochs 3 --out-dir "$runs" --device "$device"
    python3 train.py --amp-backend native --opt-level O2 --run-name n2a "${quick[@]}"
    python3 bench/cross_backend_resume.py --resume "$runs/n2a/last.pth" --amp-backend apex --device "$device"
    python3 train.py --amp-backend apex --resume auto --run-name n2a --epochs 3 --out-dir "$runs" --device "$device"
    python3 train.py --amp-backend apex --opt-level O1 --accumulate 2 --clip-grad 1 --run-name acc "${quick[@]}"
    ;;
apex_speed)
    for config in "O1 fp16" "O2 fp16"; do
        for backend in native apex; do
            python3 bench/train_throughput.py --batch 16 --configs "$config" --channels-last on --amp-backend "$backend"
        done
    done
    ;;
*)
    echo "unknown stage $stage"; exit 2
    ;;
esac
} 2>&1 | tee "$log"
