"""Real multi-process training on CPU (gloo, 2 processes) against one process on the same total batch.

train_distributed.py runs under torchrun, under the legacy `torch.distributed.launch` (which passes
--local-rank), under hand-set launcher variables, and, where the launcher is not the point, on ranks
forked from this process (`forked_launch`), through the driver of `multiprocess_runs` (no product
hook): every rank also dumps its own weights and per-step record next to the checkpoint, and one
rank's loss can be blown up at a chosen step. The runs are module fixtures shared by the assertions.

Tolerance: this network's float32 gradients at initialisation are ill-conditioned (BatchNorm over
tiny batches: one process in float32 vs float64 differs by ~5 % of the gradient norm), so 2 vs 1
processes are compared on the first step's loss (exact), on the whole parameter update (a few % at
most), and against the same run without --sync-bn (of the order of the update itself). SGD, not
AdamW: Adam's normalised step turns rounding noise in near-zero gradients into full-size steps.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
import train_parallel
from data.skeleton import builtin
from config import build_config
from config.views import SampleSettings
from data.dataset import KeypointDataset
from runtime.checkpoint import load_checkpoint
from engine.cli import run_main
from engine.loaders import GlobalBatchSampler
from models import FocalL2Loss, build_model
from child_env import child_env, find_free_port
from multiprocess_runs import (LR_EPOCH_2, NO_VALIDATION, REPO, SCHEDULE, TIMEOUT_S,
                               data_args, dumps, forked_launch, initial_weights, launch, ranks_identical,
                               records, relative_difference, weights)

COCO = builtin("coco")


# -- the runs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multiprocess")


@pytest.fixture(scope="module")
def single(out_dir, synthetic_h5) -> Path:
    """train.py, 1 process, batch 4, 2 epochs of 3 steps, a checkpoint per epoch."""
    train.main([*data_args(synthetic_h5, out_dir), *SCHEDULE, "--epochs", "2", "--save-every", "1",
                "--run-name", "single"])
    return out_dir / "single"


@pytest.fixture(scope="module")
def ddp_sync(out_dir, synthetic_h5) -> tuple[Path, str]:
    """torchrun, 2 processes of batch 2, --sync-bn --zero, 1 epoch; val loss and AP on 5 images."""
    proc = launch(out_dir, "torch.distributed.run",
                  [*data_args(synthetic_h5, out_dir), *SCHEDULE, "--epochs", "1", "--sync-bn", "--zero",
                   "--ap-every", "1", "--set", "train.ap_max_images=5", "--run-name", "ddp_sync"])
    return out_dir / "ddp_sync", proc.stdout


@pytest.fixture(scope="module")
def ddp_legacy(out_dir, synthetic_h5) -> Path:
    """The legacy launcher (--local-rank), --delay-allreduce, no --sync-bn, 1 epoch."""
    launch(out_dir, "torch.distributed.launch",
           [*data_args(synthetic_h5, out_dir), *SCHEDULE, "--epochs", "1", "--delay-allreduce",
            *NO_VALIDATION, "--run-name", "ddp_legacy"])
    return out_dir / "ddp_legacy"


# -- 2 processes vs 1 ---------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_hold_identical_parameters_after_ddp_steps(ddp_sync, ddp_legacy):
    for run_dir in (ddp_sync[0], ddp_legacy):
        rank0, rank1 = dumps(run_dir)
        assert ranks_identical(rank0, rank1, bn_statistics=False), run_dir.name
        assert [s["lr"] for s in rank0["steps"]] == [s["lr"] for s in rank1["steps"]] == [0.01] * 3
        ckpt = weights(run_dir / "last.pth")           # what rank 0 saved is what it trained
        assert all(torch.equal(ckpt[k], rank0["state"][k]) for k in ckpt)
    assert ranks_identical(*dumps(ddp_sync[0]))        # --sync-bn: running statistics agree too


@pytest.mark.slow
def test_sync_bn_ddp_trains_like_one_process_on_the_same_total_batch(single, ddp_sync):
    run_dir, stdout = ddp_sync
    assert "2 process(es) on cpu; batch 2 per process, 4 in total" in stdout
    rank0, rank1 = dumps(run_dir)
    ddp_losses = [(a["loss"] + b["loss"]) / 2 for a, b in zip(rank0["steps"], rank1["steps"])]
    # the same samples and augmentations: the first step's loss (before any update) is the same
    assert ddp_losses[0] == pytest.approx(first_step_loss(single), rel=1e-5)
    start = initial_weights()
    ddp, one = weights(run_dir / "last.pth"), weights(single / "epoch_1.pth")
    assert relative_difference(one, ddp, start) < 0.1
    assert relative_difference(one, ddp, start, buffers=True) < 0.02


def first_step_loss(single: Path) -> float:
    """Loss of the first step of the single-process run, recomputed from the initial weights."""
    cfg = build_config(None, load_checkpoint(single / "epoch_1.pth")["config"])
    dataset = KeypointDataset(cfg.data.train_h5, SampleSettings.of(cfg), train=True)
    batch = next(iter(GlobalBatchSampler(len(dataset), 4, seed=cfg.train.seed)))
    images, target, mask = (torch.stack(t) for t in zip(*(dataset[i] for i in batch)))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, COCO).train()
    with torch.no_grad():
        return FocalL2Loss(cfg.loss, COCO)(model(images), target, mask)[0].mean().item()


@pytest.mark.slow
def test_without_sync_bn_per_rank_batch_statistics_change_the_result(single, ddp_sync, ddp_legacy):
    start, one = initial_weights(), weights(single / "epoch_1.pth")
    synced = relative_difference(one, weights(ddp_sync[0] / "last.pth"), start)
    per_rank = relative_difference(one, weights(ddp_legacy / "last.pth"), start)
    assert per_rank > 0.3 and per_rank > 5 * synced
    rank0, rank1 = dumps(ddp_legacy)                   # each rank's BN saw only its own 2 samples
    key = "stem.conv.1.running_mean"
    assert not torch.equal(rank0["state"][key], rank1["state"][key])


@pytest.mark.slow
def test_legacy_launcher_passes_local_rank_and_delay_allreduce_runs(ddp_legacy):
    rank0, rank1 = dumps(ddp_legacy)
    assert "--local-rank=0" in rank0["argv"] and "--local-rank=1" in rank1["argv"]
    ckpt = load_checkpoint(ddp_legacy / "last.pth")
    assert ckpt["config"]["dist"]["delay_allreduce"] and ckpt["mode"] == "ddp" and ckpt["world_size"] == 2
    assert ckpt["step"] == 3 and not any(s["skipped"] for s in rank0["steps"])


def test_ranks_draw_different_augmentations(synthetic_h5):
    """Each sample draws its own augmentation from (seed, epoch, sample); the global batch sampler
    never hands a sample to two ranks, so the ranks' samples of a step are augmented differently,
    and N processes draw exactly what one process draws (which the test above relies on)."""
    cfg = build_config("tiny")
    dataset = KeypointDataset(synthetic_h5[0], SampleSettings.of(cfg), train=True)
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        per_rank = []
        for rank in (0, 1):
            sampler = GlobalBatchSampler(len(dataset), 4, rank, 2, seed=cfg.train.seed)
            sampler.set_epoch(epoch)
            per_rank.append([dataset.draw(i) for batch in sampler for i in batch])
        drawn = per_rank[0] + per_rank[1]
        assert len(drawn) == 36 and len(set(map(repr, drawn))) == len(drawn)
    dataset.set_epoch(0)
    first = repr(dataset.draw(0))
    dataset.set_epoch(1)
    assert repr(dataset.draw(0)) != first


# -- validation, skipping, errors ---------------------------------------------------------------
@pytest.mark.slow
def test_ddp_validation_on_uneven_shards_counts_every_sample_once(ddp_sync):
    """13 validation samples (6 + 7 per rank) for the loss and 5 images (3 + 2) for AP: the loss
    is the one process's loss of the saved weights; the epoch's train loss is both ranks' mean."""
    run_dir = ddp_sync[0]
    val = records(run_dir, "val")[0]
    assert {"loss", "AP", "AP50", "AR", "train_loss"} <= set(val)
    assert 0 <= val["AP"] <= 1
    ckpt = load_checkpoint(run_dir / "last.pth")
    cfg = build_config(None, ckpt["config"])
    dataset = KeypointDataset(cfg.data.val_h5, SampleSettings.of(cfg), train=False)
    assert len(dataset) == 13
    torch.manual_seed(0)
    model = build_model(cfg.model, COCO)
    model.load_state_dict(ckpt["model"])
    model.eval()
    with torch.no_grad():
        images, target, mask = (torch.stack(t) for t in zip(*(dataset[i] for i in range(len(dataset)))))
        expected = FocalL2Loss(cfg.loss, COCO)(model(images), target, mask)[0].mean().item()
    assert val["loss"] == pytest.approx(expected, rel=1e-5)
    rank0, rank1 = dumps(run_dir)
    mean = sum(s["loss"] for s in rank0["steps"] + rank1["steps"]) / 6
    assert val["train_loss"] == pytest.approx(mean, rel=1e-6)


@pytest.fixture(scope="module")
def ddp_skip(out_dir, synthetic_h5) -> Path:
    """2 forked ranks; only rank 1's loss is abnormal (x 1e9), at step 2 of 3."""
    forked_launch([*data_args(synthetic_h5, out_dir), *SCHEDULE, "--epochs", "1", *NO_VALIDATION,
                   "--run-name", "ddp_skip"], TEST_BLOW_UP="1:2")
    return out_dir / "ddp_skip"


@pytest.mark.slow
def test_a_skip_decided_by_one_ranks_loss_is_taken_by_both(ddp_skip):
    rank0, rank1 = dumps(ddp_skip)
    threshold = build_config("tiny").optim.skip_loss_above
    assert all(s["loss"] < threshold for s in rank0["steps"])             # rank 0's own loss was fine
    assert [s["loss"] > threshold for s in rank1["steps"]] == [False, True, False]
    for rank in (rank0, rank1):
        assert [s["skipped"] for s in rank["steps"]] == [False, True, False]
    assert ranks_identical(rank0, rank1, bn_statistics=False)
    ckpt = load_checkpoint(ddp_skip / "last.pth")
    assert ckpt["skipped_steps"] == 1 and ckpt["step"] == 3


@pytest.fixture(scope="module")
def ddp_accumulate(out_dir, synthetic_h5) -> Path:
    """2 forked ranks of batch 1, --accumulate 2, --sync-bn; rank 1's loss abnormal at step 2."""
    forked_launch([*data_args(synthetic_h5, out_dir), *SCHEDULE, "--epochs", "1", *NO_VALIDATION,
                   "--batch-size", "2", "--accumulate", "2", "--sync-bn", "--run-name", "ddp_accumulate"],
                  TEST_BLOW_UP="1:2")
    return out_dir / "ddp_accumulate"


@pytest.mark.slow
def test_accumulating_ranks_skip_together_and_stay_identical(ddp_accumulate):
    """The skip vote comes before every backward: a rank that skipped a SyncBN backward alone would
    leave the other waiting in its collective (the run would hang and time out)."""
    rank0, rank1 = dumps(ddp_accumulate)
    for rank in (rank0, rank1):
        assert [s["skipped"] for s in rank["steps"]] == [False, True, False]
    assert ranks_identical(rank0, rank1)
    ckpt = load_checkpoint(ddp_accumulate / "last.pth")
    assert (ckpt["step"], ckpt["skipped_steps"]) == (3, 1)
    assert ckpt["config"]["train"]["accumulate"] == 2 and ckpt["world_size"] == 2


@pytest.mark.slow
def test_accumulation_under_ddp_static_graph_all_reduces_every_batch(out_dir, synthetic_h5):
    """DDP's static graph mode fails an internal assert under no_sync: the engine all-reduces each
    batch there instead (the same mean gradient)."""
    forked_launch([*data_args(synthetic_h5, out_dir), *SCHEDULE, "--epochs", "1", *NO_VALIDATION,
                   "--batch-size", "2", "--accumulate", "2", "--set", "dist.static_graph=true",
                   "--run-name", "ddp_static"])
    assert ranks_identical(*dumps(out_dir / "ddp_static"), bn_statistics=False)
    assert load_checkpoint(out_dir / "ddp_static" / "last.pth")["step"] == 3


@pytest.mark.slow
def test_batch_that_does_not_divide_fails_on_every_rank_in_one_line(tmp_path, synthetic_h5):
    """Two processes started by hand (RANK, WORLD_SIZE, MASTER_*): each prints one line, exits 2."""
    port = str(find_free_port())
    args = [*data_args(synthetic_h5, tmp_path), "--batch-size", "3", "--run-name", "odd"]
    procs = [subprocess.Popen([sys.executable, "train_distributed.py", *args], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port))
             for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for proc, (_, stderr) in zip(procs, outputs):
        assert proc.returncode == 2, stderr[-2000:]
        assert stderr.strip().splitlines() == [
            "error: option train.batch_size: 3 does not divide over 2 processes (it is the total batch)"]


# -- checkpoints across modes -------------------------------------------------------------------
@pytest.mark.slow
def test_ddp_zero_checkpoint_resumes_in_train_py(out_dir, single, ddp_sync):
    """The --zero checkpoint is one consolidated file; train.py continues its epoch, step and LR."""
    ddp_ckpt = load_checkpoint(ddp_sync[0] / "last.pth")
    assert len(ddp_ckpt["optimizer"]["state"]) == len(ddp_ckpt["model"]) - 3 * len(
        [k for k in ddp_ckpt["model"] if k.endswith("running_mean")])   # every parameter's momentum
    train.main(["--resume", str(copied_into(out_dir / "resumed", ddp_sync[0] / "last.pth")),
                "--epochs", "2", "--out-dir", str(out_dir), *NO_VALIDATION])
    check_continued(out_dir / "resumed", single)


@pytest.mark.slow
def test_a_resume_on_another_process_count_without_sync_bn_says_how_batchnorm_changes(
        out_dir, ddp_legacy, ddp_sync, capsys):
    """2 gloo ranks of batch 2 each, then 1 process of batch 4: BatchNorm's batch changes (said);
    with --sync-bn it normalises the 4 samples on both counts (nothing said)."""
    capsys.readouterr()
    train.main(["--resume", str(copied_into(out_dir / "legacy_on_1", ddp_legacy / "last.pth")),
                "--epochs", "2", "--out-dir", str(out_dir)])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BatchNorm")]
    assert said == ["BatchNorm now normalises batches of 4 samples, not 2 as in the run resumed (2 "
                    "process(es) then, 1 now, --sync-bn off): the weights will differ from that run's "
                    "straight through; --sync-bn normalises the whole batch on any count"]
    train.main(["--resume", str(copied_into(out_dir / "sync_on_1", ddp_sync[0] / "last.pth")),
                "--epochs", "2", "--out-dir", str(out_dir), *NO_VALIDATION])
    assert "BatchNorm now" not in capsys.readouterr().out


@pytest.mark.slow
def test_train_py_checkpoint_continues_under_ddp_with_2_processes(out_dir, single):
    forked_launch(["--resume", copied_into(out_dir / "continued", single / "epoch_1.pth"), "--epochs", "2",
                   "--out-dir", out_dir, "--sync-bn", *NO_VALIDATION])
    check_continued(out_dir / "continued", single)
    rank0, rank1 = dumps(out_dir / "continued")
    assert [s["lr"] for s in rank0["steps"]] == [s["lr"] for s in rank1["steps"]] == [LR_EPOCH_2] * 3


def copied_into(run_dir: Path, checkpoint: Path) -> Path:
    """`checkpoint` copied into a new run directory: `--resume` of the copy continues the run there."""
    run_dir.mkdir()
    return Path(shutil.copy(checkpoint, run_dir / checkpoint.name))


def check_continued(run_dir: Path, single: Path) -> None:
    """Epoch 2 of a run resumed from an epoch-1 checkpoint: the straight run's epoch, step, LR, weights."""
    ckpt = load_checkpoint(run_dir / "last.pth")
    assert (ckpt["epoch"], ckpt["iteration"], ckpt["step"]) == (2, 0, 6)
    train_records = records(run_dir, "train")
    assert [(r["epoch"], r["step"]) for r in train_records] == [(1, 6)]
    assert train_records[0]["lr"] == pytest.approx(LR_EPOCH_2)
    assert relative_difference(weights(single / "epoch_2.pth"), ckpt["model"], initial_weights()) < 0.15


def test_train_parallel_runs_on_the_cpu_and_says_so(out_dir, synthetic_h5, single, capsys):
    train_parallel.main([*data_args(synthetic_h5, out_dir), *SCHEDULE, "--epochs", "1",
                         "--run-name", "parallel"])
    assert "runs on the CPU" in capsys.readouterr().out
    ckpt = load_checkpoint(out_dir / "parallel/last.pth")
    assert ckpt["mode"] == "dataparallel"
    one = weights(single / "epoch_1.pth")             # the very computation of train.py
    assert all(torch.equal(one[k], ckpt["model"][k]) for k in one)


def test_train_parallel_refuses_sync_bn_in_one_line_and_writes_nothing(tmp_path, synthetic_h5, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(train_parallel.main, [*data_args(synthetic_h5, tmp_path), "--sync-bn"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "error: --sync-bn under train_parallel.py: DataParallel keeps the batch statistics of the "
        "first GPU's share of the batch; for synchronised BatchNorm run one process per GPU: "
        "torchrun --nproc_per_node N train_distributed.py --sync-bn"]
    assert list(tmp_path.iterdir()) == []
