"""Train on one device: a GPU when there is one, else the CPU.

    python train.py                                   # the project's own dataset, tiny preset
    python train.py --config imhn512 --train-h5 coco_train.h5 --val-h5 coco_val.h5 --opt-level O1
    python train.py --resume auto --run-name RUN
    python train.py --weights best.pth --freeze stem 'stacks.0.*' --lr 1e-5
"""
from engine.cli import build_parser, config_from_args, run_main, single_process_context


def main(argv=None) -> dict:
    args = build_parser(__doc__).parse_args(argv)   # first: --help and a mistyped flag need no torch
    from engine.checkpoints import CheckpointReader
    from engine.run_trainer import Launch, build_trainer
    from inference.evaluation import training_evaluator
    from inference.val_pictures import write_val_pictures
    reader = CheckpointReader()     # the command line and the trainer read a resumed checkpoint once
    cfg = config_from_args(args, reader)
    return build_trainer(cfg, Launch(single_process_context(cfg.train.device)), training_evaluator(),
                         draw=write_val_pictures, reader=reader).fit()


if __name__ == "__main__":
    run_main(main)
