"""engine/cli.py: flags -> Config, as a user meets it (another run's config.yaml, --weights of
another network). Only the config is built: no training, so these take well under a second."""
from __future__ import annotations

import pytest
import torch
import yaml

from data.skeleton import builtin
from common.errors import ConfigError
from config.loader import build_config, to_dict
from runtime.checkpoint import save_checkpoint
from engine.cli import build_parser, config_from_args
from models import build_model

COCO = builtin("coco")


def config_of(*argv):
    return config_from_args(build_parser("test").parse_args([str(a) for a in argv]))


def test_a_runs_config_yaml_starts_a_new_run_with_its_settings(tmp_path, capsys):
    saved = to_dict(build_config("tiny", sets=["train.run_name=old", "train.resume=auto",
                                               "train.weights=pre.pth", "optim.lr=0.0123", "train.epochs=7"]))
    saved["train"]["overwrite"] = True      # as a run saved it before --resume and --overwrite were refused
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    cfg = config_of("--config", tmp_path / "config.yaml", "--epochs", 9)
    identity = (cfg.train.run_name, cfg.train.resume, cfg.train.weights, cfg.train.overwrite)
    assert identity == ("", "", "", False)
    assert cfg.optim.lr == 0.0123 and cfg.train.epochs == 9     # its settings, then the flags
    # what it leaves out of that run is said in one line
    said = capsys.readouterr().out.strip().splitlines()
    assert said == [f"--config {tmp_path / 'config.yaml'}: a new run with that run's settings but not "
                    "its run name old nor its --weights pre.pth: it trains from scratch; to continue that "
                    "run instead: --resume auto --run-name old --out-dir checkpoints"]
    cfg = config_of("--config", tmp_path / "config.yaml", "--run-name", "new", "--resume", "auto")
    assert (cfg.train.run_name, cfg.train.resume) == ("new", "auto")
    # a preset-like YAML (no top-level preset key, as users write them) keeps what it says
    (tmp_path / "mine.yaml").write_text("base: tiny\ntrain: {run_name: mine, weights: pre.pth}\n")
    cfg = config_of("--config", tmp_path / "mine.yaml")
    assert (cfg.train.run_name, cfg.train.weights) == ("mine", "pre.pth")


def test_a_resume_that_gives_settings_again_keeps_the_run_changes_what_may_change_or_refuses(
        tmp_path, capsys):
    """The run's stored config is the base, its own preset given again included; an equal value is
    a no-op, another one is said per setting or refused in one line naming the option."""
    run = build_config("tiny", sets=["train.batch_size=4", "train.max_steps_per_epoch=3", "train.epochs=2",
                                     "train.freeze=[stem]", "data.train_h5=x.h5", "train.run_name=R"])
    (tmp_path / "R").mkdir()
    torch.save({"format_version": 1, "config": to_dict(run)}, tmp_path / "R" / "last.pth")
    resume = ["--resume", "auto", "--run-name", "R", "--out-dir", tmp_path]
    cfg = config_of(*resume, "--config", "tiny", "--epochs", 6, "--batch-size", 4, "--freeze", "stem",
                    "--train-h5", "x.h5", "--lr", "0.1")
    assert (cfg.train.batch_size, cfg.train.max_steps_per_epoch, cfg.train.freeze, cfg.data.train_h5,
            cfg.train.epochs, cfg.optim.lr, cfg.preset) == (4, 3, ["stem"], "x.h5", 6, 0.1, "tiny")
    assert capsys.readouterr().out.splitlines() == [
        "--lr (optim.lr) changes from 0.002 to 0.1",
        "--epochs (train.epochs) changes from 2 to 6: LR milestones [0.7, 0.9] move from epochs [1, 2] to "
        "[4, 5]"]
    config_of(*resume, "--sync-bn")       # what the engine carries across a resume: said
    assert capsys.readouterr().out.splitlines() == ["--sync-bn (dist.sync_bn) changes from False to True"]
    for given, named in ((["--seed", 3], "--seed (train.seed) from 0 to 3"),
                         (["--batch-size", 8], "--batch-size (train.batch_size) from 4 to 8"),
                         (["--opt-level", "O1"], "--opt-level (amp.opt_level) from "),
                         (["--freeze", "stem", "stacks.0.*"], "--freeze (train.freeze) from ['stem'] to "),
                         (["--config", "imhn"],
                          "--config imhn changes --input-size (data.input_size) from 128 to 512; "
                          "model.stacks")):
        with pytest.raises(ConfigError) as error:
            config_of(*resume, *given)
        assert named in str(error.value) and "which a resume keeps" in str(error.value)
        assert "\n" not in str(error.value)


def test_weights_of_another_network_say_which_settings_build_it(tmp_path):
    other = build_config("tiny", sets=["model.channels=48"])
    path = tmp_path / "other.pth"
    save_checkpoint(path, {"model": build_model(other.model, COCO).state_dict(), "config": to_dict(other)})
    with pytest.raises(ConfigError) as error:
        config_of("--weights", path)
    message = str(error.value)
    assert message.startswith(f"--weights {path} holds another network (model.channels 48 there, 32 here)")
    assert "add --set model.channels=48 to build it" in message and "\n" not in message
    assert config_of("--weights", path, "--set", "model.channels=48").model.channels == 48
    assert config_of("--weights", path, "--allow-partial").train.allow_partial is True
    # a checkpoint of a preset's network names the preset
    tiny = tmp_path / "tiny.pth"
    torch.save({"format_version": 1, "config": to_dict(build_config("tiny"))}, tiny)
    with pytest.raises(ConfigError, match=r"model.stacks 2 there, 4 here; .*add --config tiny to build it"):
        config_of("--weights", tiny, "--config", "imhn")


def test_channels_last_is_on_for_cuda_by_default_and_can_be_turned_off():
    from engine.precision import NativePrecision as Precision
    auto = config_of().amp
    assert auto.channels_last == "auto"
    assert Precision(auto, torch.device("cuda")).channels_last          # measured faster on an H100
    assert not Precision(auto, torch.device("cpu")).channels_last
    off = config_of("--channels-last", "False").amp
    assert not Precision(off, torch.device("cuda")).channels_last
    assert Precision(config_of("--channels-last").amp, torch.device("cpu")).channels_last
    assert "channels_last" in Precision(auto, torch.device("cuda")).describe()
    with pytest.raises(ConfigError, match="option amp.channels_last: 'sometimes' is not auto, true or false"):
        config_of("--set", "amp.channels_last=sometimes")


FLOAT16 = ("--opt-level", "O1", "--amp-dtype", "float16")     # where a loss scale applies


def test_a_switch_is_not_taken_for_a_loss_scale():
    with pytest.raises(ConfigError,
                       match="option amp.loss_scale: True is not 'dynamic' or a number from 2\\^-24 to 2\\^24"):
        config_of("--set", "amp.loss_scale=true")
    assert config_of(*FLOAT16, "--loss-scale", "128").amp.loss_scale == 128


@pytest.mark.parametrize("args, says", [
    (["--loss-scale", "1e-30"], "option amp.loss_scale: 1e-30 is not 'dynamic' or a number from 2^-24 to 2^24 "
                                "(smaller makes every float16 gradient under 1 zero"),
    (["--set", "amp.init_scale=1e-30"], "option amp.init_scale: 1e-30 must be >= 5.96046e-08 and <= 16777216"),
    (["--set", "amp.init_scale=1e30"], "option amp.init_scale: 1e+30 must be >= 5.96046e-08 and <= 16777216"),
])
def test_a_loss_scale_that_zeroes_or_overflows_every_float16_gradient_is_refused(args, says):
    """At 1e-30 every float16 gradient is 0: runs at two learning rates ended with the same weights."""
    with pytest.raises(ConfigError) as refused:
        config_of(*args)
    assert says in str(refused.value)
    assert config_of(*FLOAT16, "--loss-scale", str(2.0 ** -24)).amp.loss_scale == 2.0 ** -24   # legal bounds
    assert config_of(*FLOAT16, "--loss-scale", "0.5").amp.loss_scale == 0.5


@pytest.mark.parametrize("content,says", [
    (b"train: [1, 2\n", "malformed YAML at line 2, column 1: expected ',' or ']'"),
    (b"\xff\xfe\x00binary", "not a YAML file (not UTF-8 text)"),
    (b"#" * (17 << 20), "17 MiB is too large for a YAML config or skeleton file"),
    (b"- 1\n- 2\n", "must hold a mapping of config sections"),
])
def test_a_bad_yaml_file_is_one_line_naming_it(tmp_path, content, says):
    """--config and --skeleton read their files the same way (config.loader.read_yaml)."""
    from data.skeleton import load_skeleton
    path = tmp_path / "mine.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as refusal:
        config_of("--config", path)
    message = str(refusal.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message
    if "mapping" not in says:       # a list is a fine YAML document: the skeleton says what it lacks
        with pytest.raises(ConfigError) as refusal:
            load_skeleton(str(path))
        assert str(refusal.value) == f"--skeleton {message}"


def test_repeated_freeze_flags_add_up():
    assert config_of("--freeze", "stem", "--freeze", "stacks.0", "stacks.1.b").train.freeze == \
        ["stem", "stacks.0", "stacks.1.b"]
    assert config_of("--freeze", "stem").train.freeze == ["stem"]


@pytest.mark.parametrize("sets,says", [
    (["train.resume=run/last.pth", "train.weights=w.pth"], "--resume run/last.pth and --weights: give one"),
    (["train.resume=run/last.pth", "train.resume_reference=r.pth"],
     "--resume run/last.pth and --resume-reference: give one"),
    (["train.resume=auto", "train.overwrite=true"], "--resume auto and --overwrite: give one"),
    (["train.resume_reference=r.pth", "train.weights=w.pth"], "--resume-reference and --weights: give one"),
])
def test_a_run_starts_one_way(sets, says):
    """Two ways to start were resolved silently (the resume won, --overwrite removed what --resume auto
    would continue); they are refused before anything is read or written."""
    with pytest.raises(ConfigError, match=f"^{says}"):
        build_config("tiny", sets=sets)
    # a requeued job: the first start takes the weights, every later one resumes its run
    assert build_config("tiny", sets=["train.resume=auto", "train.weights=w.pth"]).train.weights == "w.pth"


# every flag, one value each, and the field it sets
FLAG_VALUES = {
    "--train-h5": ("a.h5", "data.train_h5", "a.h5"), "--val-h5": ("b.h5", "data.val_h5", "b.h5"),
    "--workers": ("3", "data.workers", 3), "--input-size": ("128", "data.input_size", 128),
    "--epochs": ("7", "train.epochs", 7), "--batch-size": ("6", "train.batch_size", 6),
    "--accumulate": ("2", "train.accumulate", 2), "--seed": ("5", "train.seed", 5),
    "--run-name": ("r", "train.run_name", "r"), "--out-dir": ("o", "train.out_dir", "o"),
    "--resume": ("x.pth", "train.resume", "x.pth"), "--weights": ("w.pth", "train.weights", "w.pth"),
    "--resume-reference": ("ref.pth", "train.resume_reference", "ref.pth"),
    "--allow-partial": (None, "train.allow_partial", True), "--freeze": ("stem", "train.freeze", ["stem"]),
    "--overwrite": (None, "train.overwrite", True), "--device": ("cpu", "train.device", "cpu"),
    "--val-every": ("2", "train.val_every", 2), "--ap-every": ("3", "train.ap_every", 3),
    "--save-every": ("4", "train.save_every", 4), "--early-stop": ("5", "train.early_stop_patience", 5),
    "--lr": ("0.5", "optim.lr", 0.5), "--optimizer": ("adamw", "optim.name", "adamw"),
    "--clip-grad": ("2.5", "optim.clip_grad_norm", 2.5),
    "--warmup-epochs": ("1.5", "optim.warmup_epochs", 1.5),
    "--ema": ("0.99", "train.ema", 0.99), "--opt-level": ("O1", "amp.opt_level", "O1"),
    "--keep-batchnorm-fp32": ("False", "amp.keep_batchnorm_fp32", False),
    "--loss-scale": ("128", "amp.loss_scale", 128.0), "--amp-dtype": ("bfloat16", "amp.dtype", "bfloat16"),
    "--channels-last": ("True", "amp.channels_last", True), "--compile": (None, "amp.compile", True),
    "--cuda-graphs": ("False", "amp.cuda_graphs", False),
    "--amp-backend": ("native", "amp.backend", "native"), "--sync-bn": (None, "dist.sync_bn", True),
    "--delay-allreduce": (None, "dist.delay_allreduce", True), "--zero": (None, "dist.zero", True),
}


def test_each_flag_declared_beside_its_field_sets_that_field():
    from config.loader import to_dict
    from engine.cli import _resolve_config
    from config.schema import FLAG_GROUPS, flags
    declared = {flag.name: key for key, flag in flags() if flag.group in FLAG_GROUPS}
    assert set(declared) == set(FLAG_VALUES)
    assert declared == {name: key for name, (_, key, _) in FLAG_VALUES.items()}
    alone = ("--resume-reference", "--resume")             # each refused with --weights
    runs = [{name: v for name, v in FLAG_VALUES.items() if name not in alone}]
    for given in runs + [{name: FLAG_VALUES[name]} for name in alone]:
        argv = [arg for name, (value, _, _) in given.items() for arg in (name, value) if arg is not None]
        values = to_dict(_resolve_config(build_parser("test").parse_args(argv))[0])
        for name, (_, key, expected) in given.items():
            section, field = key.split(".")
            assert values[section][field] == expected, name


def test_a_flag_that_takes_a_word_offers_its_fields_choices_and_stride_declares_its_one_value():
    from config.loader import check_value
    from config.schema import declared
    actions = {a.option_strings[0]: a for a in build_parser("test")._actions if a.option_strings}
    assert actions["--opt-level"].choices == ["O0", "O1", "O2", "O3"]
    assert actions["--amp-backend"].choices == ["native", "apex"]
    assert actions["--amp-dtype"].choices == list(declared("amp.dtype")["choices"])
    with pytest.raises(ConfigError, match="option data.stride: 8 is not 4"):
        check_value("data.stride", 8)          # the declaration refuses what the network cannot take
