"""Train on several GPUs of one machine with DataParallel: model and loss replicated together, so
only per-sample losses come back to the first GPU. --sync-bn is refused (use train_distributed.py).

    python train_parallel.py --gpus 0,1,2,3 --config imhn512 --train-h5 coco_train.h5 ...
"""
from common.errors import ConfigError, refuse_inapplicable
from engine.cli import build_parser, config_from_args, run_main, single_process_context


def _gpu_ids(cfg, spec: str, visible: int) -> list[int]:
    """The GPUs --gpus `spec` names (all `visible` when none), after the checks DataParallel needs."""
    from engine.precision import check_data_parallel
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()] if spec else list(range(visible))
    except ValueError:
        raise ConfigError(f"--gpus {spec!r}: expected a comma-separated list like 0,1,2,3") from None
    bad = [i for i in ids if not 0 <= i < visible]
    if bad:
        raise ConfigError(f"--gpus {spec}: GPU(s) {bad} not visible ({visible} visible)")
    check_data_parallel(cfg.amp, len(ids))
    if cfg.train.batch_size % len(ids):
        raise ConfigError(f"option train.batch_size: {cfg.train.batch_size} does not divide over "
                          f"{len(ids)} GPUs")
    if cfg.amp.compile and len(ids) > 1:
        raise ConfigError("option amp.compile: a compiled model's replicas under DataParallel still "
                          "run the module on the first GPU; for compiled multi-GPU training use "
                          "torchrun train_distributed.py")
    return ids


def main(argv=None) -> dict:
    parser = build_parser(__doc__)
    parser.add_argument("--gpus", default="", help="comma-separated GPU ids (default: all visible)")
    args = parser.parse_args(argv)                  # first: --help and a mistyped flag need no torch
    import torch
    from tqdm import tqdm
    from engine.checkpoints import CheckpointReader
    from engine.run_trainer import Launch, build_trainer
    from inference.evaluation import training_evaluator
    from inference.val_pictures import write_val_pictures
    reader = CheckpointReader()     # the command line and the trainer read a resumed checkpoint once
    cfg = config_from_args(args, reader)
    if cfg.dist.sync_bn:
        raise ConfigError("--sync-bn under train_parallel.py: DataParallel keeps the batch statistics "
                          "of the first GPU's share of the batch; for synchronised BatchNorm run one "
                          "process per GPU: torchrun --nproc_per_node N train_distributed.py --sync-bn")
    if not torch.cuda.is_available() or cfg.train.device == "cpu":
        refuse_inapplicable({"--gpus": args.gpus or None}, "on the CPU", "no CUDA GPU is in use here, so "
                            "train_parallel.py trains on the CPU without DataParallel")
        tqdm.write("no CUDA GPU in use: train_parallel.py runs on the CPU, without DataParallel")
        launch = Launch(single_process_context("cpu"), mode="dataparallel")
    else:
        ids = _gpu_ids(cfg, args.gpus, torch.cuda.device_count())
        launch = Launch(single_process_context(f"cuda:{ids[0]}"), mode="dataparallel", device_ids=ids)
    return build_trainer(cfg, launch, training_evaluator(), draw=write_val_pictures, reader=reader).fit()


if __name__ == "__main__":
    run_main(main)
