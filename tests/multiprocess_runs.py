"""Multi-process training runs for tests: helpers to launch and read them, and the driver script.

Run as a script (under torchrun or the legacy launcher), this file is train_distributed.py whose
ranks also dump their own weights, their weights EMA (--ema), per-step record (loss, skipped, LR),
arguments and every torch.load they made (file name, memory-mapped or not) to RUN/rankN.pt after
training, where
TEST_BLOW_UP="RANK:STEP" multiplies that rank's training loss by 1e9 at that step,
TEST_BAD_DATA="RANK:STEP" makes that rank meet a bad image (DataError) at that step,
TEST_CRASH="RANK:STEP" makes that rank fail with a RuntimeError (a bug, not bad input) there,
TEST_SLOW_VAL=SECONDS makes reading each validation sample take that long (in the DataLoader
workers), TEST_FLAT_VAL=1 makes every validation's loss the same (no improvement after the first:
early stopping), TEST_STALE_VIEW=NAME makes rank 1 see RUN/NAME as the newest checkpoint (a shared
filesystem that shows it an older state), and TEST_ABORT_BEFORE_SAVE=RANK makes that rank abort its
process group (torch's `_abort_process_group`, as the NCCL error watch did) as it starts to save a
checkpoint, writing the time (time.time()) to OUT_DIR/aborted_at. The patches are made here, in the
test's process tree only: the product has no hook for them. Imported, it gives the tests the launch
and comparison helpers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:          # run as a script from tests/
    sys.path.insert(0, str(REPO))

from child_env import child_env, find_free_port  # noqa: E402
from config import build_config                  # noqa: E402
from data.skeleton import builtin              # noqa: E402
from runtime.checkpoint import load_checkpoint    # noqa: E402
from models import build_model                   # noqa: E402

COCO = builtin("coco")

TIMEOUT_S = 240
QUICK = ["--set", "data.workers=0", "--set", "train.max_steps_per_epoch=3", "--batch-size", "4",
         "--set", "train.tensorboard=false", "--device", "cpu", "--ap-every", "0"]
# SGD, LR halved every epoch, no warm-up: the LR after a resume tells where the run stands
SCHEDULE = ["--optimizer", "sgd", "--lr", "0.01", "--warmup-epochs", "0",
            "--set", "optim.milestones=[]", "--set", "optim.decay_every=1",
            "--set", "optim.decay_factor=0.5"]
LR_EPOCH_2 = 0.005
NO_VALIDATION = ["--val-every", "0", "--ap-every", "0"]
BAD_DATA_MESSAGE = "train.h5: image 7 is not a readable image"
CRASH_MESSAGE = "a failure of the test's own making"


# -- helpers ------------------------------------------------------------------------------------
def data_args(synthetic_h5, out_dir: Path) -> list[str]:
    train_h5, val_h5 = synthetic_h5
    return ["--train-h5", str(train_h5), "--val-h5", str(val_h5), "--out-dir", str(out_dir), *QUICK]


def launch(out_dir: Path, launcher: str, args: list[str], **env) -> subprocess.CompletedProcess:
    """Two processes of the driver under `launcher` (torch.distributed.run or .launch)."""
    cmd = [sys.executable, "-m", launcher, "--nproc_per_node", "2", "--master_port",
           str(find_free_port()), __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(**env),
                          timeout=TIMEOUT_S, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def forked_launch(args: list[str], **env) -> None:
    """The driver on 2 ranks forked from this process (torchrun's variables, `env` added), without
    torchrun's agent and a Python start per rank (gloo_ranks.as_forked_ranks): for runs whose
    launcher is not what the test is about. A rank's non-zero exit fails the call."""
    from gloo_ranks import as_forked_ranks
    as_forked_ranks(_forked_driver, 2, [str(a) for a in args], env)


def _forked_driver(args: list[str], env: dict) -> None:
    os.environ.update(env)
    sys.argv = [__file__, *args]
    _patch_trainer_and_run()


def dumps(run_dir: Path) -> list[dict]:
    return [torch.load(run_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def ranks_identical(rank0: dict, rank1: dict, bn_statistics: bool = True) -> bool:
    """Whether two ranks' dumped states are bit-identical: all of them, or the parameters only
    (without --sync-bn each rank's BatchNorm statistics are its own)."""
    keys = [k for k in rank0["state"]
            if bn_statistics or ("running" not in k and "num_batches" not in k)]
    return all(torch.equal(rank0["state"][k], rank1["state"][k]) for k in keys)


def weights(path: Path) -> dict:
    return load_checkpoint(path)["model"]


def initial_weights() -> dict:
    torch.manual_seed(0)
    return build_model(build_config("tiny").model, COCO).state_dict()


def relative_difference(a: dict, b: dict, start: dict, buffers: bool = False) -> float:
    """|a - b| / |a - start| over all parameters (or all BatchNorm running statistics)."""
    keys = [k for k in a if a[k].is_floating_point() and ("running" in k) == buffers]
    diff = torch.cat([(a[k] - b[k]).flatten() for k in keys]).norm()
    update = torch.cat([(a[k] - start[k]).flatten() for k in keys]).norm()
    return (diff / update).item()


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# -- the driver (runs in the launched processes) ------------------------------------------------
def _patch_trainer_and_run() -> None:
    from engine import trainer as engine_trainer
    from runtime.checkpoint import unwrap_model
    from engine.cli import run_main
    from engine.build import ModelWithLoss

    rank = int(os.environ.get("RANK", "0"))
    blow_up, bad_data = os.environ.get("TEST_BLOW_UP"), os.environ.get("TEST_BAD_DATA")
    crash = os.environ.get("TEST_CRASH")
    Trainer = engine_trainer.Trainer
    forward, fit, run_step = ModelWithLoss.forward, Trainer.fit, Trainer.run_step
    steps = []

    def blown_forward(self, images, target, mask):
        per_sample, parts = forward(self, images, target, mask)
        if self.training and bad_data == f"{rank}:{len(steps) + 1}":
            from common.errors import DataError
            raise DataError(BAD_DATA_MESSAGE)
        if self.training and crash == f"{rank}:{len(steps) + 1}":
            raise RuntimeError(CRASH_MESSAGE)
        if self.training and blow_up == f"{rank}:{len(steps) + 1}":
            per_sample = per_sample * 1e9
        return per_sample, parts

    def recorded_step(self, inputs):
        out = run_step(self, inputs)
        steps.append(dict(loss=out.loss, skipped=out.skipped, lr=out.lr))
        return out

    def fit_and_dump(self):
        result = fit(self)
        state = {k: v.detach().clone() for k, v in unwrap_model(self.model).state_dict().items()}
        ema = [h.state_dict() for h in self.hooks if h.checkpoint_key == "ema"]
        torch.save(dict(state=state, steps=steps, argv=sys.argv[1:], loads=loads,
                        ema=ema[0] if ema else None), Path(result["run_dir"]) / f"rank{rank}.pt")
        return result

    loads, load = [], torch.load

    def recorded_load(file, *args, **kwargs):
        name = Path(file).name if isinstance(file, (str, os.PathLike)) else "?"
        loads.append([name, bool(kwargs.get("mmap"))])
        return load(file, *args, **kwargs)
    torch.load = recorded_load

    ModelWithLoss.forward, Trainer.run_step, Trainer.fit = blown_forward, recorded_step, fit_and_dump
    if os.environ.get("TEST_SLOW_VAL"):
        _slow_validation_samples(float(os.environ["TEST_SLOW_VAL"]))
    if os.environ.get("TEST_FLAT_VAL"):
        _flat_validation_loss()
    if os.environ.get("TEST_STALE_VIEW") and rank == 1:
        _stale_checkpoint_view(os.environ["TEST_STALE_VIEW"])
    if os.environ.get("TEST_ABORT_BEFORE_SAVE") == str(rank):
        _abort_before_save()
    import train_distributed
    run_main(train_distributed.main)


def _slow_validation_samples(seconds: float) -> None:
    import time
    from data.dataset import KeypointDataset
    get_item = KeypointDataset.__getitem__

    def slow_get_item(self, index):
        if not self.train:
            time.sleep(seconds)
        return get_item(self, index)
    KeypointDataset.__getitem__ = slow_get_item


def _flat_validation_loss() -> None:
    from engine.validation import Validator
    loss = Validator.loss

    def flat_loss(*args, **kwargs):
        value = loss(*args, **kwargs)          # the validation loader still runs
        return value if value is None else 1.0
    Validator.loss = flat_loss


def _abort_before_save() -> None:
    import time

    import torch.distributed as torch_dist
    from engine.checkpoints import Checkpoints
    save = Checkpoints.save

    def aborted_save(self, *args, **kwargs):
        torch_dist.distributed_c10d._abort_process_group()
        (self.run_dir.parent / "aborted_at").write_text(repr(time.time()))
        return save(self, *args, **kwargs)
    Checkpoints.save = aborted_save


def _stale_checkpoint_view(name: str) -> None:
    from engine import checkpoints

    def stale_latest(run_dir):
        return Path(run_dir) / name
    checkpoints.find_latest_checkpoint = stale_latest     # what Checkpoints.latest reads


if __name__ == "__main__":
    _patch_trainer_and_run()
