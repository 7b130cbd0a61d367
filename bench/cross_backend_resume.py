"""On a GPU: a checkpoint of one precision backend resumes in the other with
identical weights and the same loss scale.

Builds the `Trainer` that `train.py --resume CKPT --amp-backend BACKEND` builds (nothing is
trained) and compares what it would save at once with what the checkpoint holds: every weight
bit for bit (float32 in both backends; O2's master copies included) and the loss scale with the
steps since its last change (`engine.precision.loss_scale`). Exit 1 when anything differs. Like any
resume it claims the run's folder and writes its config.yaml and a resume record there.

    python bench/cross_backend_resume.py --resume RUN/last.pth --amp-backend native
    python bench/cross_backend_resume.py --resume RUN/last.pth --amp-backend apex --opt-level O2
"""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.checkpoint import load_checkpoint, unwrap_model          # noqa: E402
from engine.cli import build_parser, config_from_args, single_process_context  # noqa: E402
from engine.precision.loss_scale import grad_scaler_fields               # noqa: E402
from engine.resume import CheckpointReader                          # noqa: E402
from engine.run_trainer import Launch, build_trainer                  # noqa: E402


def main(argv=None) -> int:
    reader = CheckpointReader()
    cfg = config_from_args(build_parser(__doc__).parse_args(argv), reader)
    saved = load_checkpoint(cfg.train.resume)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = build_trainer(cfg, Launch(single_process_context(cfg.train.device)),
                                reader=reader)
    now = trainer.precision.float32_state_dict(unwrap_model(trainer.model))
    differ = [key for key, value in saved["model"].items()
              if key not in now or not torch.equal(now[key].cpu(), value.cpu())]
    scale_then = {k: grad_scaler_fields(saved.get("scaler")).get(k) for k in ("scale", "_growth_tracker")}
    scale_now = {k: grad_scaler_fields(trainer.precision.state_dict()).get(k) for k in ("scale", "_growth_tracker")}
    print(f"{cfg.train.resume} ({saved['config']['amp'].get('backend', 'native')} "
          f"{saved['config']['amp']['opt_level']}) resumed as {trainer.precision.describe()}: "
          f"{len(saved['model']) - len(differ)} of {len(saved['model'])} tensors identical; "
          f"loss scale then {scale_then}, now {scale_now}", flush=True)
    if differ:
        print(f"differ: {', '.join(differ[:10])}", flush=True)
    return 1 if differ or scale_then != scale_now else 0


if __name__ == "__main__":
    sys.exit(main())
