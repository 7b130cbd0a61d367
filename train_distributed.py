r"""Train with one process per GPU (DistributedDataParallel), on one machine or many.

    python -m runtime.launch --nproc_per_node 8 train_distributed.py ...   # torchrun, exits 2 on SIGTERM
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port PORT --nproc_per_node 8 \
        train_distributed.py ...
    python -m torch.distributed.launch --nproc_per_node 2 train_distributed.py ...   # legacy: --local_rank
    srun python train_distributed.py ...                                              # SLURM

Without a launcher it runs as one process. On CPU it uses the gloo backend.
"""
import os

# before torch is imported: c10d's C++ warnings would bury the line saying which rank failed
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from common.errors import ConfigError, UserError             # noqa: E402
from engine.cli import build_parser, config_from_args, run_main   # noqa: E402


def main(argv=None) -> dict:
    parser = build_parser(__doc__)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, dest="local_rank",
                        help="set by the legacy torch.distributed.launch")
    parser.error = lambda message: _refuse(parser, message)
    args = parser.parse_args(argv)      # first: --help needs no torch (a mistake still tells the others)
    from runtime import distributed as dist
    from engine.checkpoints import CheckpointReader
    from engine.run_trainer import Launch, build_trainer
    from inference.evaluation import training_evaluator
    from inference.val_pictures import write_val_pictures
    reader = CheckpointReader()     # the command line and the trainer read a resumed checkpoint once
    try:
        cfg = config_from_args(args, reader)
    except UserError as err:            # the others would wait for this rank to join: tell them
        dist.fail_before_group(err)
        raise
    ctx = dist.init_distributed(cfg.dist, device=cfg.train.device, local_rank_arg=args.local_rank)
    try:
        return build_trainer(cfg, Launch(ctx, mode="ddp"), training_evaluator(),
                             draw=write_val_pictures, reader=reader).fit()
    except UserError as err:            # the others may wait in a collective: tell them, then leave
        dist.end_with_error(err)
        raise
    except Exception as exc:            # a collective failed as another rank left with an error,
        other = dist.error_of_another_rank()    # or this rank failed on its own: tell the others
        if other is None:
            dist.end_with_error(UserError(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"))
            raise
        raise other from None
    finally:
        dist.cleanup()


def _refuse(parser, message: str):
    """A command-line mistake: handed to the other ranks, then the usual one line and exit code 2."""
    from runtime import distributed as dist
    line = f"{' '.join(message.split())} (see {parser.prog} --help)"
    dist.fail_before_group(ConfigError(line))
    parser.exit(2, f"error: {line}\n")


if __name__ == "__main__":
    run_main(main)
