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
