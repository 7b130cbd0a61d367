"""The learning rate is a pure function of (epoch, iteration): warm-up, step decay, resume."""
import pytest

from config.schema import OptimConfig
from engine.optim import lr_at


def test_linear_warmup_by_iteration_then_flat():
    cfg = OptimConfig(lr=1.0, warmup_epochs=2, decay_every=15)
    ipe = 10
    lrs = [lr_at(cfg, e, i, ipe) for e in range(3) for i in range(ipe)]
    assert lrs[0] == pytest.approx(1 / 20)
    assert lrs[9] == pytest.approx(10 / 20)
    assert lrs[19] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(lrs[:19], lrs[1:20]))
    assert lrs[20:] == [1.0] * 10


def test_step_decay_every_15_epochs_and_milestones():
    cfg = OptimConfig(lr=2.5e-5, warmup_epochs=0, decay_every=15, decay_factor=0.2)
    assert lr_at(cfg, 14, 99, 100) == pytest.approx(2.5e-5)
    assert lr_at(cfg, 15, 0, 100) == pytest.approx(5e-6)
    assert lr_at(cfg, 30, 0, 100) == pytest.approx(1e-6)
    cfg = OptimConfig(lr=1.0, warmup_epochs=0, milestones=[3, 5], decay_factor=0.1)
    assert [lr_at(cfg, e, 0, 10) for e in (2, 3, 4, 5, 9)] == pytest.approx([1, 0.1, 0.1, 0.01, 0.01])


def test_world_size_scaling_is_optional():
    cfg = OptimConfig(lr=2.5e-5, warmup_epochs=0)
    assert lr_at(cfg, 0, 0, 10, world_size=8) == pytest.approx(2.5e-5)
    cfg.scale_lr_by_world_size = True
    assert lr_at(cfg, 0, 0, 10, world_size=8) == pytest.approx(2e-4)


def test_milestones_as_shares_follow_the_runs_length_and_one_outside_it_is_said(capsys):
    from common.errors import ConfigError
    from config.loader import build_config
    from engine.hooks import default_hooks

    cfg = OptimConfig(lr=1.0, warmup_epochs=0, milestones=[0.7, 0.9], decay_factor=0.1)
    assert [lr_at(cfg, e, 0, 10, epochs=10) for e in (6, 7, 8, 9)] == pytest.approx([1, 0.1, 0.1, 0.01])
    assert [lr_at(cfg, e, 0, 10, epochs=20) for e in (13, 14, 17, 18)] == pytest.approx([1, 0.1, 0.1, 0.01])
    with pytest.raises(ValueError, match="shares of the run"):
        lr_at(cfg, 0, 0, 10)
    tiny = build_config("tiny")            # the preset's shares: epochs 7 and 9 of its 10, as before
    assert tiny.optim.milestones == [0.7, 0.9] and tiny.train.epochs == 10
    assert [lr_at(tiny.optim, e, 0, 1, epochs=10) / tiny.optim.lr for e in (6, 7, 9)] == pytest.approx(
        [1, 0.2, 0.04])
    with pytest.raises(ConfigError, match=r"option optim.milestones: \[7.5\] must be increasing epochs, or "
                                          "shares of train.epochs below 1"):
        build_config("tiny", sets=["optim.milestones=[7.5]"])
    said = []
    default_hooks(build_config("tiny", sets=["optim.milestones=[3,30]", "train.epochs=5"]), None, None,
                  said.append)
    default_hooks(build_config("tiny", sets=["train.epochs=1"]), None, None, said.append)
    assert said == ["optim.milestones [3, 30]: epochs [30] are not inside --epochs 5, so the LR never "
                    "decays there (shares below 1 follow the run's length)"]
