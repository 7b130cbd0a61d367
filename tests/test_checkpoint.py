"""Checkpoints: atomic saving under a full disk, clear errors for bad files, weights loading from
other layouts (prefixes, keys), partial loading, resume lookup and RNG round trips."""
from __future__ import annotations

import errno
import os
import pickle
import random
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from common.errors import CheckpointError
from runtime import checkpoint
from engine.checkpoints import find_latest_checkpoint
from runtime.checkpoint import (FORMAT_VERSION, capture_rng_state, load_checkpoint, load_weights,
                               restore_rng_state, save_checkpoint, unwrap_model)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4),
                                     head=nn.Conv2d(4, 2, 1)))


def temp_files(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(checkpoint.TEMP_SUFFIX)]


def test_round_trip_keeps_values_and_adds_format_version(tmp_path):
    model = tiny_model()
    state = {"model": unwrap_model(model).state_dict(), "epoch": 3, "step": 120,
             "best_metric": np.float64(0.25), "config": {"optim": {"lr": 1e-3, "milestones": [15]}}}
    save_checkpoint(tmp_path / "last.pth", state)
    loaded = load_checkpoint(tmp_path / "last.pth")
    assert loaded["format_version"] == FORMAT_VERSION
    assert loaded["epoch"] == 3 and loaded["step"] == 120 and loaded["config"] == state["config"]
    assert type(loaded["best_metric"]) is float and loaded["best_metric"] == 0.25
    assert torch.equal(loaded["model"]["conv.weight"], model.conv.weight)
    assert temp_files(tmp_path) == []


def test_checkpoint_gets_the_permissions_of_any_new_file(tmp_path):
    """Readable by whoever may read the user's other files (umask), not private like a temp file."""
    save_checkpoint(tmp_path / "best.pth", {"epoch": 1})
    (tmp_path / "plain.txt").write_text("")
    mode = (tmp_path / "best.pth").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.txt").stat().st_mode & 0o777 and mode & 0o044


def test_non_plain_value_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match=r"state\['config'\]\['path'\]"):
        save_checkpoint(tmp_path / "last.pth", {"config": {"path": tmp_path}})
    assert list(tmp_path.iterdir()) == []


def test_full_disk_mid_write_keeps_previous_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "last.pth"
    save_checkpoint(target, {"step": 1, "w": torch.ones(10)})
    before = target.read_bytes()
    real_save = torch.save

    class FullDisk:
        """A file that takes 2 kB, then fails like a full disk."""
        def __init__(self, file):
            self.file, self.written = file, 0

        def write(self, data):
            if self.written + len(data) > 2048:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(data)
            return self.file.write(data)

        def flush(self):
            self.file.flush()

    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f: real_save(obj, FullDisk(f)))
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(target, {"step": 2, "w": torch.zeros(100_000)})
    assert str(target) in str(error.value) and "no space left on device" in str(error.value)
    assert target.read_bytes() == before
    assert temp_files(tmp_path) == []
    assert load_checkpoint(target)["step"] == 1


def test_temp_files_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    for name in (".last.pth.k1l2d3" + checkpoint.TEMP_SUFFIX, ".epoch_3.pth.a8b9" + checkpoint.TEMP_SUFFIX):
        (tmp_path / name).write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path / "last.pth", {"step": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pth"]


def test_truncated_and_empty_files_name_the_file(tmp_path):
    good = tmp_path / "good.pth"
    save_checkpoint(good, {"step": 1, "w": torch.randn(1000)})
    data = good.read_bytes()
    for name, content in (("truncated.pth", data[: len(data) // 2]), ("empty.pth", b""),
                          ("garbage.pth", b"not a checkpoint" * 10)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match="truncated or corrupt") as error:
            load_checkpoint(tmp_path / name)
        assert str(tmp_path / name) in str(error.value)


def test_memory_mapped_reads_take_torchs_older_format_and_name_a_foreign_file(tmp_path):
    """A resume reads its checkpoint memory-mapped, which only torch.save's zip format allows: a
    checkpoint in the older format still loads, and a file torch did not write is named as such
    (torch's own message spoke of mmap and _use_new_zipfile_serialization)."""
    old_format = tmp_path / "old_format.pth"
    torch.save({"format_version": FORMAT_VERSION, "w": torch.ones(3)}, old_format,
               _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint(old_format, mmap=True)["w"], torch.ones(3))
    (tmp_path / "foreign.pth").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match="truncated or corrupt, or not written by torch.save") as error:
        load_checkpoint(tmp_path / "foreign.pth", mmap=True)
    assert "mmap" not in str(error.value)


def test_missing_file_and_foreign_file_and_newer_version(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pth")
    torch.save({"conv.weight": torch.ones(1)}, tmp_path / "plain.pth")
    with pytest.raises(CheckpointError, match="no format_version.*--weights"):
        load_checkpoint(tmp_path / "plain.pth")
    torch.save({"format_version": FORMAT_VERSION + 1}, tmp_path / "future.pth")
    with pytest.raises(CheckpointError, match="newer than this trainer"):
        load_checkpoint(tmp_path / "future.pth")


class Payload:
    """A class that weights_only loading must not instantiate."""
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_file_that_would_execute_code_is_refused(tmp_path):
    pickled = pickle.dumps({"x": Payload()}, protocol=2)
    for name, writer in (("torch_saved.pth", lambda p: torch.save({"x": Payload()}, p)),
                         ("pickled.pth", lambda p: p.write_bytes(pickled))):
        path = tmp_path / name
        writer(path)
        with pytest.raises(CheckpointError,
                           match=r"refused.*execute code.*refers to \w+\.system.*trust") as error:
            load_weights(tiny_model(), path)
        assert str(path) in str(error.value)


def test_module_prefix_removed_and_added(tmp_path):
    source = tiny_model()
    with torch.no_grad():
        source.head.weight.fill_(0.5)
    wrapped_state = nn.DataParallel(source).state_dict()
    assert all(k.startswith("module.") for k in wrapped_state)
    plain = tiny_model()
    report = load_weights(plain, {"state_dict": wrapped_state})
    assert report["loaded"] == len(plain.state_dict()) and torch.all(plain.head.weight == 0.5)

    torch.save(source.state_dict(), tmp_path / "plain.pth")
    into_wrapped = nn.DataParallel(tiny_model())
    load_weights(into_wrapped, tmp_path / "plain.pth")
    assert torch.all(into_wrapped.module.head.weight == 0.5)
    assert unwrap_model(into_wrapped) is into_wrapped.module
    assert list(unwrap_model(into_wrapped).state_dict()) == list(source.state_dict())


def test_weights_under_model_key_of_our_checkpoint_and_compile_prefix(tmp_path):
    source = tiny_model()
    with torch.no_grad():
        source.conv.bias.fill_(2.0)
    save_checkpoint(tmp_path / "best.pth", {"model": unwrap_model(source).state_dict(), "step": 5})
    target = tiny_model()
    load_weights(target, str(tmp_path / "best.pth"))
    assert torch.all(target.conv.bias == 2.0)
    compiled_keys = {"_orig_mod." + k: v for k, v in source.state_dict().items()}
    other = tiny_model()
    load_weights(other, {"weights": compiled_keys})
    assert torch.all(other.conv.bias == 2.0)


def test_mismatched_keys_listed_and_partial_loading():
    source = nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4),
                                       head=nn.Conv2d(4, 7, 1), extra=nn.Linear(2, 2)))
    with torch.no_grad():
        source.conv.weight.fill_(1.0)
    target = tiny_model()
    head_before = target.head.weight.clone()
    with pytest.raises(CheckpointError) as error:
        load_weights(target, source.state_dict())
    message = str(error.value)
    assert "2 not in the model: extra.weight, extra.bias" in message
    assert "head.weight (file [7, 4, 1, 1], model [2, 4, 1, 1])" in message
    assert "--allow-partial" in message and "\n" not in message
    assert not torch.all(target.conv.weight == 1.0)          # nothing loaded on error
    report = load_weights(target, source.state_dict(), allow_partial=True)
    assert torch.all(target.conv.weight == 1.0) and torch.equal(target.head.weight, head_before)
    assert report["unexpected"] == ["extra.weight", "extra.bias"] and report["missing"] == []
    assert [m.split(" ")[0] for m in report["mismatched"]] == ["head.weight", "head.bias"]
    assert report["loaded"] == len(target.state_dict()) - 2


def test_long_lists_are_cut_with_a_count():
    many = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])
    state = {**tiny_model().state_dict(), **{f"x.{k}": v for k, v in many.state_dict().items()}}
    with pytest.raises(CheckpointError, match="16 not in the model: .* and 6 more"):
        load_weights(tiny_model(), state)


def test_nothing_matching_is_always_an_error(tmp_path):
    torch.save({"other.weight": torch.ones(3)}, tmp_path / "other.pth")
    for allow_partial in (False, True):
        with pytest.raises(CheckpointError, match=f"nothing in {tmp_path / 'other.pth'} matches"):
            load_weights(tiny_model(), tmp_path / "other.pth", allow_partial=allow_partial)
    with pytest.raises(CheckpointError, match="holds no weights"):
        load_weights(tiny_model(), {"epoch": 3})


def test_find_latest_refuses_a_file_it_cannot_read_rather_than_save_over_it(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path / "epoch_2.pth", {"step": 200, "epoch": 2})
    save_checkpoint(tmp_path / "last.pth", {"step": 300, "epoch": 3})
    save_checkpoint(tmp_path / "best.pth", {"step": 300, "epoch": 3})
    save_checkpoint(tmp_path / "epoch_1.pth", {"step": 100, "epoch": 1})   # newest by mtime
    assert find_latest_checkpoint(tmp_path) == tmp_path / "last.pth"
    data = (tmp_path / "last.pth").read_bytes()
    save_checkpoint(tmp_path / "epoch_4.pth", {"step": 400, "epoch": 4})
    (tmp_path / "epoch_4.pth").write_bytes(data[:-40])                     # corrupt, newest step
    before = (tmp_path / "epoch_4.pth").read_bytes()
    with pytest.raises(CheckpointError, match=f"--resume auto: checkpoint {tmp_path / 'epoch_4.pth'} is "
                       "truncated or corrupt .*Nothing was overwritten: move that file out"):
        find_latest_checkpoint(tmp_path)
    assert (tmp_path / "epoch_4.pth").read_bytes() == before
    torch.save({"format_version": FORMAT_VERSION + 1, "step": 500}, tmp_path / "epoch_4.pth")
    with pytest.raises(CheckpointError, match="format version 2, newer than this trainer's 1"):
        find_latest_checkpoint(tmp_path)


def test_resume_auto_reads_the_run_directorys_checkpoints_once(tmp_path, monkeypatch):
    """The command line (to take over the saved config), the run's plan and the load of the
    weights share one reader (train.py's): one scan and one read serve all three, a checkpoint
    written in between is seen, and another reader reads for itself (no module-level cache)."""
    from config.loader import build_config, to_dict
    from engine.cli import build_parser, config_from_args
    from engine.checkpoints import CheckpointReader
    from engine.run_dir import plan_run, release_run_dir

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    saved = to_dict(build_config("tiny", sets=["train.epochs=7"]))
    save_checkpoint(run_dir / "epoch_1.pth", {"step": 3, "epoch": 1, "config": saved})
    save_checkpoint(run_dir / "epoch_2.pth", {"step": 6, "epoch": 2, "config": saved})
    reads, load = [], checkpoint.load_checkpoint

    def counted(path, *args, **kwargs):
        reads.append(Path(path))
        return load(path, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "load_checkpoint", counted)

    reader = CheckpointReader()          # what train.py hands to the command line and the trainer

    def plan():
        cfg = config_from_args(build_parser("t").parse_args(["--resume", "auto", "--run-name", "r",
                                                             "--out-dir", str(tmp_path)]), reader)
        found = plan_run(cfg, reader)
        found.reader.state(found.resume_path)          # what load_start reads the weights from
        release_run_dir(found.run_dir)
        return cfg, found.resume_path
    cfg, resumed = plan()
    assert resumed == run_dir / "epoch_2.pth" and cfg.train.epochs == 7
    assert sorted(p.name for p in reads) == ["epoch_1.pth", "epoch_2.pth", "epoch_2.pth"]  # scan, config
    save_checkpoint(run_dir / "last.pth", {"step": 9, "epoch": 3, "config": saved})
    reads.clear()
    assert plan()[1] == run_dir / "last.pth"
    assert sorted(p.name for p in reads) == ["epoch_1.pth", "epoch_2.pth", "last.pth", "last.pth"]
    reads.clear()
    CheckpointReader().state(run_dir / "last.pth")      # another reader: nothing shared through the module
    assert [p.name for p in reads] == ["last.pth"]


def draws():
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
            np.random.randn(), torch.rand(4).tolist())


def test_rng_round_trip_through_a_checkpoint_reproduces_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)
    np.random.randn()                       # leave cached gaussians in both generators
    save_checkpoint(tmp_path / "rng.pth", {"rng": capture_rng_state()})
    expected = draws()
    draws()
    restore_rng_state(load_checkpoint(tmp_path / "rng.pth")["rng"])
    assert draws() == expected


# -- the loss scaler's saved state, checked like weights ------------------------------------------
GOOD_SCALER = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
               "_growth_tracker": 3}


@pytest.mark.parametrize("change, says", [
    ({"scale": float("nan")}, "scale: nan is not a finite number"),
    ({"scale": float("inf")}, "scale: inf is not a finite number"),
    ({"scale": 0.0}, "scale: 0.0 must be >= 5.96046e-08"),
    ({"scale": 1e-30}, "scale: 1e-30 must be >= 5.96046e-08"),
    ({"scale": "1024"}, "scale: '1024' is text, not a number"),
    ({"growth_factor": float("nan")}, "growth_factor: nan is not a finite number"),
    ({"growth_factor": 1.0}, "growth_factor: 1.0 must be > 1 and <= 16"),
    ({"growth_factor": 1e9}, "growth_factor: 1000000000.0 must be > 1 and <= 16"),   # every growth overflows
    ({"backoff_factor": 1.5}, "backoff_factor: 1.5 must be >= 0.0625 and < 1"),
    ({"backoff_factor": 0}, "backoff_factor: 0 must be >= 0.0625 and < 1"),
    ({"backoff_factor": 1e-9}, "backoff_factor: 1e-09 must be >= 0.0625 and < 1"),
    ({"growth_interval": 0}, "growth_interval: 0 must be >= 1 and <= 2147483648"),
    ({"growth_interval": 10 ** 12}, "growth_interval: 1000000000000 must be >= 1 and <= 2147483648"),
    ({"growth_interval": 20.0}, "growth_interval: 20.0 is not a whole number"),
    ({"_growth_tracker": -1}, "_growth_tracker: -1 must be >= 0"),
    ({"_growth_tracker": True}, "_growth_tracker: True is not a whole number"),
    ("apex", "loss_scaler0.loss_scale: nan is not a finite number"),
    ([1024.0], "it is a list"),
])
def test_a_damaged_loss_scaler_state_is_refused_naming_the_file_and_the_field(change, says):
    from engine.precision.loss_scale import checked_scaler_state
    state = ({"loss_scaler0": {"loss_scale": float("nan"), "unskipped": 0}} if change == "apex" else
             change if isinstance(change, list) else {**GOOD_SCALER, **change})
    with pytest.raises(CheckpointError) as refused:
        checked_scaler_state(state, "checkpoint run/last.pth")
    assert str(refused.value) == (f"checkpoint run/last.pth: its loss scaler state is damaged ({says}); start "
                                  "from its weights with --weights instead of --resume")


def test_a_usable_loss_scaler_state_loads_and_a_scale_above_2_to_24_continues_from_2_to_24():
    from engine.precision.loss_scale import checked_scaler_state
    for usable in (GOOD_SCALER, {}, None, {"loss_scaler0": {"loss_scale": 2.0 ** -24, "unskipped": 5}}):
        assert checked_scaler_state(usable, "c.pth") == (usable, "")
    state, note = checked_scaler_state({**GOOD_SCALER, "scale": 1e30}, "c.pth")
    assert state == {**GOOD_SCALER, "scale": 2.0 ** 24}
    assert note == ("c.pth: its loss scale 1e+30 is above 2^24, where float16 overflows at every step; the "
                    "run continues from 2^24 (a dynamic scale lowers itself from there)")
    state, _ = checked_scaler_state({"loss_scaler0": {"loss_scale": 1e30, "unskipped": 5}}, "c.pth")
    assert state == {"loss_scaler0": {"loss_scale": 2.0 ** 24, "unskipped": 5}}


def test_the_engines_checkpoints_own_the_entries_fixed_for_a_run():
    """run_trainer.py and convert_reference.py ask `Checkpoints` for the entries; they name no key."""
    from config import build_config
    from data.skeleton import builtin, from_checkpoint
    from engine.checkpoints import Checkpoints

    cfg = build_config("tiny")
    fields = Checkpoints.run_fields(cfg, builtin("coco"), "ddp", 2, ("head.weight",))
    assert (fields["mode"], fields["world_size"], fields["fresh_tensors"]) == ("ddp", 2, ["head.weight"])
    assert fields["config"]["train"]["batch_size"] == cfg.train.batch_size
    assert from_checkpoint(fields) == builtin("coco")
    for script in ("engine/run_trainer.py", "engine/convert_reference.py"):
        source = (Path(__file__).resolve().parent.parent / script).read_text()
        assert not re.search(r"""["'](fresh_tensors|world_size|skeleton|config)["']\s*:""", source), script
