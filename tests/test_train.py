"""train.py end to end on CPU: an epoch, bit-exact resume, every opt level, freezing, bad steps."""
from __future__ import annotations

import json
import signal

import pytest
import torch

import train
from data.skeleton import builtin
from common.errors import ConfigError, DataError, TrainingDiverged
from config import build_config
from engine.cli import single_process_context
from engine.hooks import Hook
from engine.run_trainer import Launch, build_trainer
from runtime.checkpoint import load_checkpoint, save_checkpoint
from bad_inputs import one_error_line, refused, train_cli

# the tiny preset made smaller (its two stacks kept) on 64 px crops, validated at half the
# pictures' size: a run of an epoch takes about a second
SMALL = ["model.depth=2", "model.channels=12", "model.increase=4", "model.head_channels=8",
         "model.stem_channels=4", "loss.scale_weights=[0.1,0.4,1.6]", "data.input_size=64",
         "inference.scales=[0.5]"]
QUICK = ["--set", "data.workers=0", "--set", "train.max_steps_per_epoch=3", "--batch-size", "4",
         "--set", "train.tensorboard=false", *(arg for kv in SMALL for arg in ("--set", kv))]

COCO = builtin("coco")


def run(tmp_path, synthetic_h5, *extra):
    train_h5, val_h5 = synthetic_h5
    argv = ["--train-h5", str(train_h5), "--val-h5", str(val_h5), "--out-dir", str(tmp_path),
            *QUICK, *extra]
    return train.main(argv)


def weights(path):
    return load_checkpoint(path)["model"]


def test_one_epoch_writes_the_run_directory(tmp_path, synthetic_h5):
    out = run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "r")
    run_dir = tmp_path / "r"
    for name in ("last.pth", "best.pth", "config.yaml", "metrics.jsonl", "curves.png"):
        assert (run_dir / name).is_file(), name
    ckpt = load_checkpoint(run_dir / "last.pth")
    assert ckpt["epoch"] == 1 and ckpt["iteration"] == 0 and ckpt["step"] == 3
    assert not any(k.startswith("module.") for k in ckpt["model"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "val"]
    assert val and val[0]["loss"] > 0 and out["loss"] == pytest.approx(val[0]["loss"])


@pytest.mark.slow
def test_two_epochs_equal_one_plus_resume_plus_one_bit_for_bit(tmp_path, synthetic_h5):
    run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "straight")
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "resumed")
    run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "resumed", "--resume", "auto")
    a, b = weights(tmp_path / "straight/last.pth"), weights(tmp_path / "resumed/last.pth")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = load_checkpoint(tmp_path / "straight/last.pth"), load_checkpoint(tmp_path / "resumed/last.pth")
    assert ca["step"] == cb["step"] == 6
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


@pytest.mark.parametrize("level,dtype", [("O0", "auto"), ("O1", "bfloat16"), ("O1", "float16"),
                                         ("O2", "bfloat16"), ("O2", "float16"), ("O3", "bfloat16"),
                                         ("O3", "float16")])
def test_every_opt_level_trains_a_step(tmp_path, synthetic_h5, level, dtype, capsys):
    # pure float16 steps with SGD: AdamW is refused there (see the test below)
    optimizer = ["--optimizer", "sgd"] if (level, dtype) == ("O3", "float16") else []
    # the small network's float16 gradients overflow at the default first scale (2^16): start lower
    scale = ["--set", "amp.init_scale=256"] if dtype == "float16" else []
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "amp", "--opt-level", level,
        "--val-every", "0", *(["--amp-dtype", dtype] if level != "O0" else []), "--set",
        "train.max_steps_per_epoch=2", *optimizer, *scale)       # --amp-dtype does not apply at O0
    # O3 alone steps half weights: it says, once, how much of its updates the rounding takes
    said = [line for line in capsys.readouterr().out.splitlines() if "weights without float32 masters" in line]
    assert len(said) == (level == "O3") and all(line.startswith(f"{dtype} weights") for line in said)
    ckpt = load_checkpoint(tmp_path / "amp/last.pth")
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values() if v.is_floating_point())
    assert all(bool(torch.isfinite(v).all()) for v in ckpt["model"].values() if v.is_floating_point())
    torch.manual_seed(0)
    from config import build_config
    from models import build_model
    init = build_model(build_config("tiny", sets=SMALL).model, COCO).state_dict()
    changed = [k for k in init if init[k].is_floating_point() and not torch.equal(init[k], ckpt["model"][k])]
    assert changed, "no weight moved"
    if dtype == "float16" and level != "O0":
        assert ckpt["scaler"]["scale"] > 0       # the fp16 GradScaler ran and was saved
    else:
        assert not ckpt["scaler"]                # disabled scaler: empty state


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O0", "O2"])   # O2: a half model; frozen weights keep float32
def test_frozen_weights_stay_bit_identical(tmp_path, synthetic_h5, level):
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "base")
    base = weights(tmp_path / "base/last.pth")
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "ft", "--weights",
        str(tmp_path / "base/last.pth"), "--freeze", "stem", "stacks.0.*", "--lr", "1e-3",
        "--opt-level", level)
    tuned = weights(tmp_path / "ft/last.pth")
    frozen = [k for k in base if k.startswith(("stem.", "stacks.0."))]
    others = [k for k in base if k not in frozen and base[k].is_floating_point()]
    assert frozen and all(torch.equal(base[k], tuned[k]) for k in frozen)   # incl. BN running stats
    assert any(not torch.equal(base[k], tuned[k]) for k in others)


def test_o3_float16_steps_with_a_finite_gradient_norm_above_the_float16_range(tmp_path, synthetic_h5,
                                                                               monkeypatch):
    # after the real unscale, every gradient becomes 1.5 x 65504 / sqrt(N): each one finite in
    # float16, their norm 1.5 x 65504 (inf when computed in float16)
    from engine.precision import NativePrecision as Precision
    unscale = Precision.unscale_

    def large_finite_gradients(self, optimizer):
        unscale(self, optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        value = 1.5 * 65504 / sum(g.numel() for g in grads) ** 0.5
        for g in grads:
            g.fill_(value)
    monkeypatch.setattr(Precision, "unscale_", large_finite_gradients)
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "o3", "--opt-level", "O3",
        "--amp-dtype", "float16", "--optimizer", "sgd", "--loss-scale", "1", "--lr", "1e-6",
        "--val-every", "0")
    ckpt = load_checkpoint(tmp_path / "o3/last.pth")
    assert ckpt["skipped_steps"] == 0
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


def val_records(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "val"]


@pytest.mark.slow
def test_early_stop_with_ap_every_counts_only_the_validations_that_measure_ap(tmp_path, synthetic_h5):
    out = run(tmp_path, synthetic_h5, "--epochs", "4", "--run-name", "es", "--early-stop", "2",
              "--ap-every", "4", "--val-every", "1", "--set", "train.ap_max_images=4")
    val = val_records(tmp_path / "es")
    assert [r["epoch"] for r in val] == [0, 1, 2, 3] and "AP" in val[-1]
    assert out["epoch"] == 4 and not out["early_stopped"]


def test_early_stop_returns_the_epoch_it_stopped_at(tmp_path, synthetic_h5):
    # the validation loss of epoch 2 is that of epoch 1, no improvement, and patience 1 stops the
    # run there (a run whose every step is skipped, which gave that before, is now a failure)
    class SameLoss(Hook):
        def after_validation(self, trainer, epoch, results):
            results["loss"] = 1.0

    sets = [f"data.train_h5={synthetic_h5[0]}", f"data.val_h5={synthetic_h5[1]}", "data.workers=0",
            f"train.out_dir={tmp_path}", "train.run_name=es1", "train.batch_size=4", "train.max_steps_per_epoch=3",
            "train.epochs=4", "train.early_stop_patience=1", "train.ap_every=0", "train.tensorboard=false"]
    out = build_trainer(build_config("tiny", sets=[*SMALL, *sets]), Launch(single_process_context("cpu")),
                        hooks=[SameLoss()]).fit()
    assert out["early_stopped"] and out["epoch"] == 2
    assert load_checkpoint(tmp_path / "es1/last.pth")["epoch"] == 2
    assert len(val_records(tmp_path / "es1")) == 2


def test_abnormal_loss_is_skipped_and_counted_and_a_run_of_skips_only_is_no_success(tmp_path, synthetic_h5):
    """Every step skipped (fewer than optim.max_bad_steps): the run used to end with exit code 0 and
    a last.pth of its untouched weights. It ends diverged, writing nothing."""
    sets = [f"data.train_h5={synthetic_h5[0]}", "data.workers=0", f"train.out_dir={tmp_path}",
            "train.run_name=skip", "train.batch_size=4", "train.max_steps_per_epoch=3", "train.epochs=1",
            "train.val_every=0", "train.tensorboard=false", "optim.skip_loss_above=1e-30",
            "optim.max_bad_steps=100"]
    trainer = build_trainer(build_config("tiny", sets=[*SMALL, *sets]), Launch(single_process_context("cpu")))
    with pytest.raises(TrainingDiverged, match="all 3 steps of this run were skipped") as stopped:
        trainer.fit()
    assert f"{tmp_path / 'skip/last.pth'} was not written. No checkpoint was written before" in str(stopped.value)
    assert not (tmp_path / "skip/last.pth").exists() and trainer.optim_step.skipped_total == 3
    torch.manual_seed(0)
    from models import build_model
    init = build_model(build_config("tiny", sets=SMALL).model, COCO).state_dict()
    state = trainer.model.state_dict()
    assert all(torch.equal(init[k], state[k]) for k in init)   # BN statistics included


@pytest.mark.slow
def test_a_damaged_loss_scaler_is_refused_on_resume_and_a_resume_that_only_skips_is_not_called_good(
        tmp_path, synthetic_h5, capsys):
    """A NaN, text or backoff above 1 in a checkpoint's scaler used to be resumed (every step then
    skipped), and the diverged run named the file it resumed 'the last good checkpoint'."""
    fp16 = ["--opt-level", "O1", "--amp-dtype", "float16", "--set", "amp.init_scale=8", "--val-every", "0"]
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "s", *fp16)
    last = tmp_path / "s/last.pth"
    good = load_checkpoint(last)
    resume = ["--train-h5", synthetic_h5[0], "--out-dir", tmp_path, *QUICK, "--epochs", "2", "--run-name", "s",
              "--resume", "auto", *fp16]
    for field, value, says in (("scale", float("nan"), "scale: nan is not a finite number"),
                               ("scale", "1024", "scale: '1024' is text, not a number"),
                               ("growth_factor", 1e9, "growth_factor: 1000000000.0 must be > 1 and <= 16")):
        save_checkpoint(last, {**good, "scaler": {**good["scaler"], field: value}})
        refused(capsys, train_cli, resume, [f"checkpoint {last}: its loss scaler state is damaged ({says})"],
                tmp_path / "s")
    save_checkpoint(last, good)
    with pytest.raises(TrainingDiverged) as stopped:
        train.main([str(a) for a in resume] + ["--set", "optim.skip_loss_above=1e-30", "--set", "optim.max_bad_steps=2"])
    assert f"stopped. Every step since the resume from {last} was skipped; that checkpoint is as it was; " \
           "resume it with one of these changes" in str(stopped.value)        # it used to be "no good start"
    assert "no good start" not in str(stopped.value) and "last good" not in str(stopped.value)


@pytest.mark.parametrize("named", [True, False], ids=["misspelt --run-name", "another --out-dir"])
def test_resume_auto_that_finds_no_run_is_refused_naming_the_folder_it_looked_in(tmp_path, capsys, named):
    """It used to start a new run on the synthetic dataset, its one line scrolling away."""
    (tmp_path / "runs").mkdir()
    argv = ["--out-dir", tmp_path / "runs", "--resume", "auto", *(["--run-name", "tpyo"] if named else [])]
    where = (f"found no run in {tmp_path / 'runs' / 'tpyo'} (no checkpoint, no config.yaml): check --run-name"
             if named else f"found no run in {tmp_path / 'runs'}: give the --out-dir the runs were written to")
    refused(capsys, train_cli, argv, [f"--resume auto: {where}", "name its data (--train-h5) or weights"],
            tmp_path)
    assert [p.name for p in tmp_path.rglob("*")] == ["runs"]          # no folder made either


def test_a_requeued_run_starts_afresh_saying_so_and_its_folder_holds_its_log_and_environment(
        tmp_path, synthetic_h5, capsys):
    import cv2
    import numpy
    capsys.readouterr()
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "q", "--resume", "auto", "--val-every", "0")
    run_dir = tmp_path / "q"
    said = capsys.readouterr().out.splitlines()
    assert said[:2] == [f"run directory: {run_dir}", f"--resume auto: no checkpoint in {run_dir} yet, starting afresh"]
    assert (run_dir / "train.log").read_text().splitlines() == said        # the console, without progress bars
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["opencv"] == cv2.__version__
    assert env["versions"]["numpy"] == numpy.__version__
    assert {"python", "cuda", "cudnn", "h5py", "pycocotools"} <= env["versions"].keys() and "apex" in env
    assert env["git"]["commit"] is None or len(env["git"]["commit"]) == 40
    assert env["device"] == "cpu" and env["devices"] and env["command"]
    # resumed under another OpenCV (as recorded): one line says so, and the log goes on
    env["versions"]["opencv"] = "4.9.0"
    (run_dir / "environment.json").write_text(json.dumps(env))
    with pytest.raises(TrainingDiverged):
        run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "q", "--resume", "auto", "--val-every", "0",
            "--set", "optim.skip_loss_above=1e-30", "--set", "optim.max_bad_steps=2")
    log = (run_dir / "train.log").read_text().splitlines()
    assert log[:len(said)] == said and log[len(said)] == f"run directory: {run_dir}"
    assert f"the environment differs from this run's earlier start: opencv 4.9.0 -> {cv2.__version__} " \
           f"(now in {run_dir / 'environment.json'})" in log
    assert log[-1].startswith("error: 2 consecutive steps had a non-finite or abnormal loss")   # its last line
    resumed = json.loads((run_dir / "environment.json").read_text())
    assert resumed["versions"]["opencv"] == cv2.__version__
    assert resumed["earlier_starts"] == [env]          # each start's record kept (it used to be replaced)


def test_too_many_bad_steps_stop_the_run(tmp_path, synthetic_h5):
    with pytest.raises(TrainingDiverged, match="3 consecutive steps") as stopped:
        run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "div",
            "--set", "optim.skip_loss_above=1e-30", "--set", "optim.max_bad_steps=3")
    # the first epoch: no checkpoint to point at
    assert "No checkpoint was written before" in str(stopped.value)
    assert not (tmp_path / "div/last.pth").exists()


def test_existing_run_directory_is_never_overwritten(tmp_path, synthetic_h5):
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "keep")
    before = (tmp_path / "keep/last.pth").read_bytes()
    with pytest.raises(ConfigError, match="already holds a run"):
        run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "keep")
    assert (tmp_path / "keep/last.pth").read_bytes() == before


def test_a_finished_run_gives_back_the_signal_handlers_it_installed(tmp_path, synthetic_h5):
    """train.main inside a user's process (a sweep, a notebook) leaves SIGTERM/SIGUSR1 as it found them."""
    def mine(signum, frame):
        pass
    before = signal.signal(signal.SIGUSR1, mine)
    try:
        run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "handlers", "--val-every", "0")
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.slow
def test_resuming_an_earlier_checkpoint_leaves_the_rolled_back_records_out_of_the_curves(tmp_path,
                                                                                        synthetic_h5):
    """A run resumed from epoch_1.pth after epoch 2 was logged: epoch 2's first records stay in
    metrics.jsonl (nothing is deleted) but behind a resume marker, and the curves use the new ones."""
    from engine.logger import RunLogger
    run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "again", "--save-every", "1")
    run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "again",
        "--resume", str(tmp_path / "again/epoch_1.pth"))
    run_dir = tmp_path / "again"
    raw = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw if r["kind"] == "resume"] == [3]
    assert [r["step"] for r in raw if r["kind"] == "val"] == [3, 6, 6]
    kept = RunLogger(run_dir, enabled=True, tensorboard=False).read()
    assert [(r["kind"], r["step"]) for r in kept] == [("train", 3), ("val", 3), ("resume", 3),
                                                      ("train", 6), ("val", 6)]
    assert kept[-1]["time"] == raw[-1]["time"]          # the record of the resumed run, not the first
    logger = RunLogger(run_dir, enabled=True, tensorboard=False)
    steps = [(r["kind"], r["step"]) for r in logger.read(logger.steps_path)]   # each step's loss
    assert steps == [("step", 1), ("step", 2), ("step", 3), ("resume", 3), ("step", 4), ("step", 5),
                     ("step", 6)]


def test_ap_validation_runs_without_cudnn_autotuning_and_gives_it_back(tmp_path, synthetic_h5, monkeypatch):
    """cuDNN autotuning pays for the fixed training shape; evaluation images come in many sizes,
    each of which would be autotuned anew."""
    import inference.evaluation
    seen = []
    evaluate_h5 = inference.evaluation.evaluate_h5

    def recording(*args, **kwargs):
        seen.append(torch.backends.cudnn.benchmark)
        return evaluate_h5(*args, **kwargs)

    monkeypatch.setattr(inference.evaluation, "evaluate_h5", recording)
    previous = torch.backends.cudnn.benchmark
    try:
        run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "ap", "--ap-every", "1",
            "--set", "train.ap_max_images=2", "--val-every", "0")
        assert seen == [False] and torch.backends.cudnn.benchmark is True   # train.cudnn_benchmark
    finally:
        torch.backends.cudnn.benchmark = previous


@pytest.mark.slow
def test_a_checkpoint_of_an_older_version_resumes_with_new_flags(tmp_path, synthetic_h5):
    """Configs saved before amp.channels_last became auto-or-switch (false), when loss scales were
    kept as strings ('128.0'), and before train.accumulate existed."""
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "old", "--val-every", "0")
    path = tmp_path / "old/last.pth"
    state = torch.load(path, weights_only=False)
    state["config"]["amp"].update(channels_last=False, loss_scale="128.0")
    del state["config"]["train"]["accumulate"]
    torch.save(state, path)
    run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "old", "--val-every", "0",
        "--resume", "auto", "--channels-last", "True", "--accumulate", "2")
    done = load_checkpoint(path)
    assert (done["config"]["amp"]["channels_last"], done["config"]["amp"]["loss_scale"]) == (True, "128.0")
    assert done["config"]["train"]["accumulate"] == 2 and done["epoch"] == 2 and done["step"] == 3 + 3


@pytest.mark.slow
def test_a_compiled_run_compiles_the_training_graph_only_and_trains_like_an_eager_one(
        tmp_path, synthetic_h5, monkeypatch):
    """`--compile` compiles one graph, the training step's. Validation (no grad, eval mode, a smaller
    last batch) runs the same weights eagerly: compiling those two graphs took minutes on a GPU.
    Dynamo traces for real; its "eager" backend leaves out Inductor's code generation (minutes on CPU)."""
    from torch._dynamo.utils import counters
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, backend="eager", **kw))
    torch._dynamo.reset()
    counters.clear()
    compiled = run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "compiled", "--compile")
    assert counters["stats"]["unique_graphs"] == 1
    eager = run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "eager")
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    with_compile, without = (weights(tmp_path / name / "last.pth") for name in ("compiled", "eager"))
    assert with_compile.keys() == without.keys()          # no "_orig_mod." prefix
    assert all(torch.allclose(with_compile[k].float(), without[k].float(), atol=1e-5) for k in without)


def test_a_validation_file_given_as_training_data_is_one_error_line(tmp_path, synthetic_h5, capsys):
    from common.errors import run_cli
    val = synthetic_h5[1]
    before = val.read_bytes()
    code = run_cli(train.main, ["--train-h5", str(val), "--out-dir", str(tmp_path), "--run-name", "r", *QUICK])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: --train-h5 {val}: holds the 'val' split, but 'train' is needed "
                                 "here (a val file never feeds training); convert the train split with "
                                 "--split train"]
    assert not (tmp_path / "r").exists() and val.read_bytes() == before


def test_weights_that_turned_nan_never_replace_a_checkpoint(tmp_path, synthetic_h5):
    """A step that leaves a NaN in the weights (pure float16 does it, for one) while the loss is
    still finite: the epoch's end must not write it over the last good last.pth, and the run ends
    as diverged, naming the file it kept."""
    class PoisonAWeight(Hook):
        def after_step(self, trainer, out):
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] = float("nan")

    sets = [f"data.train_h5={synthetic_h5[0]}", "data.workers=0", f"train.out_dir={tmp_path}",
            "train.run_name=poisoned", "train.batch_size=2", "train.max_steps_per_epoch=1",
            "train.val_every=0", "train.ap_every=0", "train.tensorboard=false", "train.device=cpu"]
    launch = Launch(single_process_context("cpu"))
    build_trainer(build_config("tiny", sets=[*SMALL, *sets, "train.epochs=1"]), launch).fit()
    before = (tmp_path / "poisoned/last.pth").read_bytes()
    resumed = build_config("tiny", sets=[*SMALL, *sets, "train.epochs=2", "train.resume=auto"])
    with pytest.raises(TrainingDiverged, match="after step 2 the weights hold NaN or infinite") as stopped:
        build_trainer(resumed, launch, hooks=[PoisonAWeight()]).fit()
    assert f"{tmp_path / 'poisoned/last.pth'} still holds the weights it held" in str(stopped.value)
    assert (tmp_path / "poisoned/last.pth").read_bytes() == before


@pytest.mark.parametrize("dtype, refused", [("float16", True), ("bfloat16", False)])
def test_pure_float16_with_adamw_is_refused_before_anything_is_built(tmp_path, synthetic_h5, dtype, refused):
    """O3 in float16 with AdamW makes every weight NaN at its first step (eps is 0 in float16)."""
    argv = ("--epochs", "1", "--run-name", f"o3{dtype}", "--opt-level", "O3", "--optimizer", "adamw",
            "--amp-dtype", dtype, "--device", "cpu", "--val-every", "0")
    if refused:
        with pytest.raises(ConfigError, match="O3 with --optimizer adamw in float16"):
            run(tmp_path, synthetic_h5, *argv)
        assert not (tmp_path / f"o3{dtype}").exists()
    else:
        run(tmp_path, synthetic_h5, *argv)
        assert all(bool(torch.isfinite(v).all()) for v in weights(tmp_path / f"o3{dtype}/last.pth").values()
                   if v.is_floating_point())


def test_a_config_built_in_python_is_refused_as_the_command_line_is(tmp_path, synthetic_h5):
    sets = [f"data.train_h5={synthetic_h5[0]}", f"train.out_dir={tmp_path}", "train.run_name=api",
            "amp.opt_level=O3", "amp.dtype=float16", "optim.name=adamw", "train.device=cpu"]
    with pytest.raises(ConfigError, match="O3 with --optimizer adamw in float16"):
        build_trainer(build_config("tiny", sets=sets), Launch(single_process_context("cpu")))
    assert not (tmp_path / "api").exists()


@pytest.mark.parametrize("device", ["0", "0,1", "cuda:1", "cuda"])
def test_every_spelling_of_a_gpu_gets_float16_and_its_refusal(tmp_path, synthetic_h5, device):
    """`--amp-dtype auto` is float16 on every --device that names GPUs (0,1 as much as cuda), so O3
    with AdamW is refused there, before the device is looked for (this machine may have none)."""
    from engine.precision import NativePrecision
    from config.schema import AmpConfig
    assert NativePrecision.half_dtype(AmpConfig(), device) == torch.float16
    assert NativePrecision.half_dtype(AmpConfig(), "cpu") == torch.bfloat16
    with pytest.raises(ConfigError, match="O3 with --optimizer adamw in float16"):
        run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "gpu", "--opt-level", "O3",
            "--optimizer", "adamw", "--device", device)


# -- what --resume auto does with a run folder in each state (engine.run_dir.folder_state) ----------
def killed_before_its_first_checkpoint(tmp_path, synthetic_h5, name="k"):
    """The folder a run leaves when it is killed before its first checkpoint: config.yaml and its log."""
    from config.loader import to_yaml
    sets = [*SMALL, "train.max_steps_per_epoch=2", "data.workers=0", "train.tensorboard=false",
            "optim.lr=0.001"]
    cfg = build_config("tiny", {"data": {"train_h5": str(synthetic_h5[0])}, "train": {"epochs": 1}}, sets)
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / name / "train.log").write_text(f"run directory: {tmp_path / name}\n")
    return tmp_path / name


def test_a_run_killed_before_its_first_checkpoint_restarts_from_its_own_config(tmp_path, synthetic_h5,
                                                                               capsys):
    """Its documented restart used to train the default preset on the synthetic data and write that
    config over the run's config.yaml."""
    import yaml
    run_dir = killed_before_its_first_checkpoint(tmp_path, synthetic_h5)
    before = yaml.safe_load((run_dir / "config.yaml").read_text())
    capsys.readouterr()
    train.main(["--resume", "auto", "--run-name", "k", "--out-dir", str(tmp_path)])
    assert f"--resume auto: no checkpoint in {run_dir} yet, restarting the run from step 0 with its own " \
           "config.yaml (data, preset, options; it was stopped before its first checkpoint)" \
           in capsys.readouterr().out
    saved = load_checkpoint(run_dir / "last.pth")
    after = yaml.safe_load((run_dir / "config.yaml").read_text())
    for config in (saved["config"], after):
        assert config["data"]["train_h5"] == str(synthetic_h5[0]) and config["optim"]["lr"] == 0.001
        assert {k: v for k, v in config.items() if k != "train"} == \
            {k: v for k, v in before.items() if k != "train"}
    assert saved["epoch"] == 1 and saved["step"] == 2


def test_a_restart_whose_config_yaml_is_damaged_is_refused_naming_it(tmp_path, synthetic_h5, capsys):
    run_dir = killed_before_its_first_checkpoint(tmp_path, synthetic_h5)
    (run_dir / "config.yaml").write_text("optim: [unclosed\n")
    refused(capsys, train_cli, ["--resume", "auto", "--run-name", "k", "--out-dir", tmp_path],
            [f"{run_dir / 'config.yaml'}: malformed YAML"], tmp_path)


@pytest.mark.slow
def test_resume_auto_that_picks_a_finished_run_says_it_was_already_complete(tmp_path, synthetic_h5, capsys):
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "f", "--val-every", "0")
    last = (tmp_path / "f" / "last.pth").read_bytes()
    capsys.readouterr()
    train.main(["--resume", "auto", "--out-dir", str(tmp_path), *QUICK])       # no run name: the newest
    said = capsys.readouterr().out.splitlines()
    assert said[1] == (f"--resume auto: {tmp_path / 'f' / 'last.pth'}: it has already finished its epochs: "
                       "nothing to train (raise --epochs to go on)")
    assert (tmp_path / "f" / "last.pth").read_bytes() == last


def run_with_worker_1_held(tmp_path, synthetic_h5, monkeypatch, held_s: float, name: str, *extra) -> int:
    """A run with 2 DataLoader workers whose worker 1 waits `held_s` before its first sample."""
    import time

    from data.dataset import CompactSamples
    load, held = CompactSamples.__getitem__, []          # each worker its own copy of `held`

    def slow_worker_1(self, key):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 1 and not held:
            held.append(time.sleep(held_s))
        return load(self, key)
    monkeypatch.setattr(CompactSamples, "__getitem__", slow_worker_1)
    return train_cli(["--train-h5", synthetic_h5[0], "--out-dir", tmp_path, "--run-name", name, *QUICK,
                      "--set", "data.workers=2", "--epochs", "1", "--val-every", "0", *extra])


@pytest.mark.slow          # DataLoader workers
def test_a_run_whose_dataloader_worker_is_stuck_ends_after_the_batch_timeout(tmp_path, synthetic_h5, capsys,
                                                                              monkeypatch):
    """A worker that never hands its batch over (a deadlock, a hung read) ends the run with one line
    after `data.batch_timeout_s`, and no worker outlives it; before, the run waited forever."""
    import multiprocessing
    import time

    started = time.monotonic()
    assert run_with_worker_1_held(tmp_path, synthetic_h5, monkeypatch, 3600, "stuck",
                                  "--set", "data.batch_timeout_s=2") == 2
    assert time.monotonic() - started < 60
    line = one_error_line(capsys.readouterr().err)
    assert line == ("error: no batch came from the 2 DataLoader workers in 2 s: one is stopped or stuck "
                    "(option data.batch_timeout_s sets this wait)")
    assert not multiprocessing.active_children()


@pytest.mark.slow          # DataLoader workers
def test_a_batch_that_comes_after_some_polls_of_the_loader_is_taken_in_its_place(tmp_path, synthetic_h5,
                                                                                 monkeypatch):
    """Worker 1's first batch 2.5 s late, the loader polling every 0.5 s: the run ends with the
    weights of a run whose workers were never late (no batch lost, repeated or reordered)."""
    import time

    from engine import loaders

    clock_reads = []               # one per batch asked for, and one per poll that ended empty
    monkeypatch.setattr(loaders, "monotonic", lambda: clock_reads.append(1) or time.monotonic())
    assert run_with_worker_1_held(tmp_path, synthetic_h5, monkeypatch, 0, "prompt") == 0
    prompt_reads, clock_reads[:] = len(clock_reads), []
    monkeypatch.setattr(loaders, "POLL_S", 0.5)
    assert run_with_worker_1_held(tmp_path, synthetic_h5, monkeypatch, 2.5, "late",
                                  "--set", "data.batch_timeout_s=30") == 0
    assert len(clock_reads) - prompt_reads >= 3          # the loader's polls did end empty
    prompt, late = weights(tmp_path / "prompt/last.pth"), weights(tmp_path / "late/last.pth")
    assert all(torch.equal(prompt[k], late[k]) for k in prompt)


@pytest.mark.parametrize("paused_s", [0, 1200])
def test_a_wait_for_a_batch_counts_only_the_time_this_process_ran(monkeypatch, paused_s):
    """Waiting 20 s in 5 s polls of the loader (torch raises "DataLoader timed out" after each) ends
    after 4 polls; a pause of the whole job (SLURM's suspend) during the second does not count."""
    from engine import loaders
    clock, polls = [0.0], []

    class Loader:                 # torch's loader iterator with `timeout` POLL_S and a worker gone quiet
        _workers = [None, None]

        def __next__(self):
            polls.append(clock[0])
            clock[0] += loaders.POLL_S + (paused_s if len(polls) == 2 else 0)
            raise RuntimeError(f"DataLoader timed out after {loaders.POLL_S} seconds")
    monkeypatch.setattr(loaders, "monotonic", lambda: clock[0])
    with pytest.raises(DataError, match="no batch came from the 2 DataLoader workers in 20 s"):
        next(loaders._AsRaisedInWorker(Loader(), 20))
    assert len(polls) == (5 if paused_s else 4)
