"""What a run writes besides checkpoints (metrics.jsonl, train_steps.jsonl, TensorBoard, curves.png,
train.log, environment.json), on the main process; a resume's record rolls back the later ones."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from tqdm import tqdm

from common.errors import UserError, os_reason
from common.paths import written_whole
from runtime.environment import changed_versions, describe_environment

SHARES = ("AP", "PCK", "AUC")      # validation metrics from 0 to 1 that curves.png draws (the first found)
CURVES_EVERY_S = 60.0              # curves.png redrawn at most this often, and at the run's end


@contextlib.contextmanager
def writing(path: Path):
    """A failed write becomes one error line naming the file."""
    try:
        yield
    except OSError as exc:
        kept = path.parent / "last.pth"
        raise UserError(f"cannot write {path}: {os_reason(exc)}"
                        + (f"; the last good checkpoint {kept} is intact" if kept.exists() else "")) from None


class RunConsole:
    """The run's console lines, said on the main process and appended to RUN/train.log."""

    def __init__(self, enabled: bool):
        self.enabled, self.path, self.waiting = enabled, None, []

    def __call__(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text)
            self.record(text)

    def record(self, text: str) -> None:
        """Keep a line in train.log without printing it (the error line the command prints)."""
        if not self.enabled:
            return
        if self.path is None:
            self.waiting.append(text)
            return
        with writing(self.path), open(self.path, "a") as fh:
            fh.write(text + "\n")

    def open(self, run_dir: Path, device, world_size: int) -> None:
        """Start train.log, write environment.json (earlier starts kept in `earlier_starts`; changes said)."""
        if not self.enabled:
            return
        self.path, waiting, self.waiting = Path(run_dir) / "train.log", self.waiting, []
        path, now = Path(run_dir) / "environment.json", describe_environment(device, world_size)
        changed = []
        if path.is_file():           # a resume: the earlier starts' records are kept in the file
            with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
                before = json.loads(path.read_text())
                now["earlier_starts"] = [*before.pop("earlier_starts", []), before]
                changed = changed_versions(before, now)
        with writing(path), written_whole(path, option="--out-dir") as temp:
            temp.write_text(json.dumps(now, indent=1) + "\n")
        for text in waiting:
            self.record(text)
        if changed:
            self(f"the environment differs from this run's earlier start: {'; '.join(changed)} "
                 f"(now in {path})")


class RunLogger:
    """The run's records in `run_dir`, written from `open()` on."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True):
        self.run_dir, self.enabled, self.tensorboard = Path(run_dir), enabled, tensorboard
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.steps_path = self.run_dir / "train_steps.jsonl"
        self.curves_path = self.run_dir / "curves.png"
        self.tb, self.drawn_at = None, time.monotonic()

    def open(self, resumed_step: int | None = None) -> "RunLogger":
        """Start writing; `resumed_step`: where a resumed run continues from."""
        if self.enabled and self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                purge = None if resumed_step is None else resumed_step + 1
                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
            except Exception:   # tensorboard not installed: metrics.jsonl and curves.png still work
                self.tb = None
        for path in (self.metrics_path, self.steps_path):
            if self.enabled and path.exists():    # a line cut by a crash must not swallow ours
                with writing(path), open(path, "rb+") as fh:
                    if size := fh.seek(0, 2):
                        fh.seek(size - 1)
                        if fh.read(1) != b"\n":
                            fh.write(b"\n")
        if resumed_step is not None:
            self.log("resume", resumed_step)
            self._append(self.steps_path, {"kind": "resume", "step": resumed_step})
        return self

    def _append(self, path: Path, record: dict) -> None:
        with writing(path), open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def log_step(self, step: int, loss: float) -> None:
        """The training loss of one step (this process's), for curves.png."""
        if self.enabled:
            self._append(self.steps_path, {"kind": "step", "step": step, "loss": float(loss)})

    def log(self, kind: str, step: int, **values) -> None:
        """Append one record ({"kind": "train"|"val"|..., "step": N, ...}) to metrics.jsonl."""
        if not self.enabled:
            return
        self._append(self.metrics_path, {"kind": kind, "step": step, "time": round(time.time(), 3), **values})
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(f"{kind}/{key}", value, step)

    def log_image(self, tag: str, path, step: int) -> None:
        if self.tb is None:
            return
        import cv2
        if (picture := cv2.imread(str(path), cv2.IMREAD_COLOR)) is not None:
            self.tb.add_image(tag, picture[:, :, ::-1].copy(), step, dataformats="HWC")

    def read(self, path: Path | None = None) -> list[dict]:
        """The records of metrics.jsonl (or `path`) but those a later resume rolled back."""
        path = path or self.metrics_path
        if not path.exists():
            return []
        out = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:   # a line cut by a kill: skip it
                continue
            if not (isinstance(record, dict) and isinstance(record.get("kind"), str)
                    and isinstance(record.get("step"), int) and not isinstance(record["step"], bool)):
                continue                   # not one of our records: nothing stored is trusted
            if record.get("kind") == "resume":
                out = [r for r in out if r.get("step", 0) <= record["step"]]
            out.append(record)
        return out

    def plot_curves(self, now: bool = False) -> None:
        """Loss, metric and LR against the step, in curves.png: `now`, or once CURVES_EVERY_S have
        passed since the last drawing (one took about 1 s of CPU in a profile here)."""
        if not self.enabled or not (now or time.monotonic() - self.drawn_at >= CURVES_EVERY_S):
            return
        self.drawn_at = time.monotonic()
        from matplotlib.figure import Figure      # not pyplot: no backend, no global figures
        records = self.read()
        train = [r for r in records if r["kind"] == "train"]
        steps = [r for r in self.read(self.steps_path) if r["kind"] == "step"
                 and isinstance(r.get("loss"), (int, float))] or train
        val = [r for r in records if r["kind"] == "val"]
        # one step axis for both; its autoscale margins keep points at the ends inside
        fig = Figure(figsize=(10, 3.6))
        axes = fig.subplots(1, 2, sharex=True)
        dots = "." if len(steps) < 60 else None        # a short run: each step visible
        axes[0].plot([r["step"] for r in steps], [r["loss"] for r in steps], marker=dots, lw=1,
                     label="train loss (each step)" if steps is not train else "train loss")
        if with_loss := [r for r in val if "loss" in r]:
            axes[0].plot([r["step"] for r in with_loss], [r["loss"] for r in with_loss], "o-",
                         label="val loss")
        axes[0].set(yscale="log", xlabel="step", ylabel="loss")
        key = next((k for k in SHARES if any(k in r for r in val)), None)   # AP, else PCK, else AUC
        if with_ap := [r for r in val if key in r]:
            ap_axis = axes[0].twinx()
            ap_axis.plot([r["step"] for r in with_ap], [r[key] for r in with_ap], "s-", color="g",
                         label=f"val {key} (last {with_ap[-1][key]:.3f})")
            ap_axis.set(ylabel=key, ylim=(0, 1))
        fig.legend(loc="upper right", bbox_to_anchor=(1, 1), bbox_transform=axes[0].transAxes,
                   fontsize="small")          # the lines of the loss axis and of its metric twin
        axes[1].plot([r["step"] for r in train], [r["lr"] for r in train],
                     marker="." if len(train) < 60 else None)
        axes[1].set(xlabel="step", ylabel="learning rate")
        fig.tight_layout()
        with writing(self.curves_path), written_whole(self.curves_path, option="--out-dir") as tmp:
            fig.savefig(tmp, dpi=80)

    def close(self) -> None:
        self.plot_curves(now=True)
        if self.tb is not None:
            self.tb.close()
