"""Every CUDA path of the trainer and the figures only a GPU gives, in one 9-minute device call: the
PARALLEL sections side by side (tiny), then the ALONE ones (imhn512); SMOKE_BUDGET_S (530) bounds it.

    python bench/gpu_smoke.py --cpu-check            # anywhere: every section at toy sizes on a CPU
"""
from __future__ import annotations

import time

_START = time.perf_counter()
import torch  # noqa: E402

_IMPORT_TORCH_S = time.perf_counter() - _START

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.helpers import (bench_config, build_quietly, count_host_syncs, free_memory,  # noqa: E402
                           optimizer_step_counters, run_entry, synthetic_batches, sync)
from config import build_config  # noqa: E402
from data.skeleton import builtin  # noqa: E402

_IMPORT_ALL_S = time.perf_counter() - _START
CUDA = torch.cuda.is_available()
SYNTHETIC = ROOT / "checkpoints" / "_synthetic"
BUDGET_S = float(os.environ.get("SMOKE_BUDGET_S", 530))


def emit(section: str, **fields) -> dict:
    line = {"section": section, **fields}
    print(json.dumps(line, default=str), flush=True)
    return line


def left_s() -> float:
    return BUDGET_S - (time.perf_counter() - _START)


def device_of(check: bool) -> torch.device:
    return torch.device("cpu" if check else "cuda")


def quick_args(out_dir: str, check: bool) -> list[str]:
    """A tiny run of a few steps: cuDNN benchmarking, AP, TensorBoard and pictures off."""
    return ["--config", "tiny", "--epochs", "2", "--set", "train.max_steps_per_epoch=3",
            "--set", "train.ap_every=0", "--set", "train.cudnn_benchmark=false",
            "--set", "train.tensorboard=false", "--device", device_of(check).type, "--out-dir", out_dir]


def tiny_runs(script: str, check: bool, first: list[str], resumed: list[str] | None = None) -> list:
    """`script`'s results: a tiny run of `first`, then with `resumed` that run resumed to epoch 3."""
    main = importlib.import_module(script).main
    with tempfile.TemporaryDirectory() as out:
        runs = [run_entry(main, [*first, *quick_args(out, check)], check)]
        if resumed is not None:
            runs.append(run_entry(main, [*resumed, "--resume", "auto", "--epochs", "3", "--out-dir", out,
                                         "--device", device_of(check).type], check))
    return runs


def trained(result: dict) -> dict:
    return {"status": "ok", "step": result.get("step"), "loss": result.get("loss")}


def run_section(script: str, first: list[str], resumed: list[str] | None = None):
    """The section of `tiny_runs`: the last run's step and loss."""
    return lambda check: trained(tiny_runs(script, check, first, resumed)[-1])


# -- the side-by-side sections -------------------------------------------------------------------
def section_levels(check: bool) -> dict:
    rows = {}
    for name, opts in [("O1 fp16", ["--opt-level", "O1", "--amp-dtype", "float16"]),
                       ("O1 bf16", ["--opt-level", "O1", "--amp-dtype", "bfloat16"]),
                       ("O2", ["--opt-level", "O2"]), ("O3", ["--opt-level", "O3", "--optimizer", "sgd"])]:
        run = ["--run-name", name.replace(" ", "")]
        try:
            first, resumed = tiny_runs("train", check, [*opts, "--ema", "0.99", *run], run)
            rows[name] = {"ok": True, **{k: first.get(k) for k in ("step", "loss")},
                          "resumed_to_step": resumed.get("step"), "resumed_loss": resumed.get("loss")}
        except (Exception, SystemExit) as exc:      # noqa: BLE001 - one row's failure, reported
            rows[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"status": "ok" if all(r["ok"] for r in rows.values()) else "failed", "levels": rows}


def section_entries(check: bool) -> dict:
    import evaluate
    import train_parallel
    with tempfile.TemporaryDirectory() as out:
        result = run_entry(train_parallel.main, ["--opt-level", "O1", "--run-name", "dp",
                                                 *quick_args(out, check)], check)
        scored = run_entry(evaluate.main, ["--weights", f"{out}/dp/last.pth", "--h5", str(SYNTHETIC / "val.h5"),
                                           "--max-images", "8", "--device", device_of(check).type,
                                           "--no-progress"], check)
    return {**trained(result), "evaluated": scored,
            "status": "ok" if scored in (0, {"parsed": True}) else "failed"}


def section_feed(check: bool) -> dict:
    """The device feed (2 workers, --accumulate 2) under the CUDA sanitizer (left in workers)."""
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        from torch.cuda import _sanitizer

        def sanitizer_off():
            _sanitizer.cuda_sanitizer.dispatch.__exit__(None, None, None)
            _sanitizer.cuda_sanitizer.enabled = False
        os.register_at_fork(after_in_child=sanitizer_off)
    result = tiny_runs("train", check, ["--opt-level", "O1", "--workers", "2", "--accumulate", "2",
                                        "--cuda-graphs", "false", "--run-name", "feed"])[0]
    return {**trained(result), "sanitizer": os.environ.get("TORCH_CUDA_SANITIZER")}


def section_nccl_abort(check: bool) -> dict:
    """What a group of one does after `_abort_process_group()` (a watchdog ends a hung call)."""
    import torch.distributed as td
    from torch import nn
    from torch.distributed.distributed_c10d import _abort_process_group
    from torch.nn.parallel import DistributedDataParallel
    from bench.group_of_one import join_group_of_one
    from runtime import distributed as dist

    seen = {"handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    device = torch.device("cuda", 0) if CUDA and not check else torch.device("cpu")
    seen["backend"] = join_group_of_one(device, 20)
    model = DistributedDataParallel(nn.Linear(8, 8).to(device), device_ids=[0] if device.type == "cuda" else None)
    x = torch.randn(4, 8, device=device)
    model(x).sum().backward()
    sync(device)
    current = {"call": "abort"}

    def watchdog():
        time.sleep(25)
        emit(f"nccl_abort_{seen['handling']}", status="hung", hung_in=current["call"], **seen)
        os._exit(3)
    threading.Thread(target=watchdog, daemon=True).start()
    _abort_process_group()
    seen["is_initialized_after_abort"] = td.is_initialized()
    calls = [("all_reduce_sum", lambda: dist.all_reduce_sum(torch.ones(1, device=device))),
             ("decided_on_main", lambda: dist.decided_on_main(lambda: "decided")),
             ("barrier", dist.barrier),
             ("torch_all_reduce", lambda: td.all_reduce(torch.ones(1, device=device))),
             ("ddp_next_step", lambda: (model(x).sum().backward(), sync(device)))]
    for name, call in calls:
        current["call"] = name
        print(f"probe: calling {name}", flush=True)
        try:
            seen[name] = f"returned {call()!r}"[:160]
        except Exception as exc:      # noqa: BLE001 - what each call does is the finding
            seen[name] = f"raised {type(exc).__name__}: {exc}"[:200]
        print(f"probe: {name}: {seen[name]}", flush=True)
    return {"status": "ok", **seen}


def section_sync_debug(check: bool) -> dict:
    """Device waits per step beside the project's host-read counter, without and with --sync-bn."""
    from bench.group_of_one import force_sync_function, join_group_of_one
    from engine.cli import single_process_context
    from engine.run_trainer import Launch

    ctx = single_process_context(device_of(check).type)
    ctx.backend, ctx.distributed = join_group_of_one(ctx.device, 20), True
    rows = {}
    for sync_bn in (False, True):
        cfg = bench_config("tiny" if check else "imhn512", 64 if check else 256, 4, ctx.device.type,
                           SYNTHETIC / "train.h5", f"dist.sync_bn={sync_bn}", "amp.opt_level=O1")
        trainer, parts, _ = build_quietly(cfg, Launch(ctx, mode="ddp"))
        if sync_bn and ctx.device.type == "cuda":
            force_sync_function(trainer.net)
        batch = next(synthetic_batches(4, cfg, ctx.device))
        for _ in range(2):
            trainer.run_step([batch])
        sync(ctx.device)
        steps = 3
        # on CUDA the counter also counts torch's sync-debug warnings outside a read, as cuda_sync
        with count_host_syncs(optimizer_step_counters(parts.optimizer), ctx.device) as reads:
            for _ in range(steps):
                trainer.run_step([batch])
            sync(ctx.device)
        rows["sync_bn" if sync_bn else "plain_bn"] = {
            "device_waits_per_step": reads.count / steps if ctx.device.type == "cuda" else None,
            "project_counter_per_step": (reads.count - reads.by_kind["cuda_sync"]) / steps}
        del trainer, parts
        gc.collect()
    return {"status": "ok", **rows}


G1 = ["--opt-level", "O1", "--sync-bn", "--force-sync-function", "--run-name", "g1"]
APEX = ["--amp-backend", "apex", "--run-name", "apex", "--opt-level"]
PARALLEL = {"levels": section_levels, "entries": section_entries,
            "group_of_one": run_section("bench.group_of_one", [*G1, "--zero", "--accumulate", "2"],
                                        [*G1, "--delay-allreduce"]),
            "feed": section_feed, "apex_O1": run_section("train", [*APEX, "O1"]),
            "apex_O2": run_section("train", [*APEX, "O2"]),
            "apex_O3": run_section("train", [*APEX, "O3", "--optimizer", "sgd"]),
            "apex_sync_bn": run_section("bench.group_of_one", ["--amp-backend", "apex", "--opt-level", "O1",
                                                               "--sync-bn", "--run-name", "g1"]),
            "nccl_abort_3": section_nccl_abort, "nccl_abort_2": section_nccl_abort,
            "sync_debug": section_sync_debug}
SECTION_ENV = {"feed": {"TORCH_CUDA_SANITIZER": "1"}, "nccl_abort_3": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
               "nccl_abort_2": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}}


def forked_section(name: str, env: dict, log) -> multiprocessing.Process:
    """--cpu-check: section `name` forked from this process, in a session of its own (on the GPU each
    is a fresh interpreter, since CUDA cannot be forked; here that would import torch 11 times)."""
    def child():
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.exit(run_one(name, True))
    (process := multiprocessing.get_context("fork").Process(target=child)).start()
    return process


def run_side_by_side(names: list[str], check: bool, logs: Path, alone: int) -> list[dict]:
    """Each section in its own process, all at once, leaving about 80 s per `alone` section."""
    limit = max(60.0, min(240.0, left_s() - 80 * alone))
    procs = {}
    for name in names:
        env = {**os.environ, **SECTION_ENV.get(name, {}), "PYTHONUNBUFFERED": "1"}
        if check:
            env.pop("TORCH_CUDA_SANITIZER", None)
        log = open(logs / f"{name}.log", "w")
        procs[name] = (forked_section(name, env, log) if check else
                       subprocess.Popen([sys.executable, __file__, "--section", name], cwd=ROOT, env=env,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                       log, time.perf_counter())
    lines = []
    for name, (proc, log, started) in procs.items():
        wait, exit_code = (proc.join, lambda: proc.exitcode) if check else (proc.wait, proc.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            wait(timeout=max(1.0, limit - (time.perf_counter() - started)))
        if exit_code() is None:
            os.killpg(proc.pid, 9)
            wait()
        rc = exit_code()
        log.close()
        text = (logs / f"{name}.log").read_text(errors="replace").splitlines()
        seconds = round(time.perf_counter() - started, 1)
        found = [ln for ln in text if ln.startswith('{"section"')]
        if found:
            lines.append(emit(**{**json.loads(found[-1]), "rc": rc, "seconds": seconds}))
        else:
            error = next((ln for ln in text if ln.startswith("error:") or "Error" in ln or "CSAN" in ln),
                         text[-1] if text else "no output")
            lines.append(emit(name, status=f"failed: {error}"[:300], rc=rc, seconds=seconds,
                              last_lines=text[-6:]))
    return lines


def apex_imports() -> bool:
    with contextlib.suppress(ImportError):
        importlib.import_module("apex")
        return True
    return False


def run_one(name: str, check: bool) -> int:
    """`--section NAME`: that section here, its JSON line last."""
    skip = not check and ("Apex does not import" if name.startswith("apex") and not apex_imports()
                          else "no CUDA" if name in PARALLEL and not CUDA else "")
    if skip:
        emit(name, status=f"skipped: {skip}")
        return 0
    return 1 if str(timed(name, check).get("status")).startswith("failed: ") else 0


def timed(name: str, check: bool) -> dict:
    """Section `name` run here, as its JSON line: its fields and seconds, or its failure."""
    started = time.perf_counter()
    try:
        fields = SECTIONS[name](check)
    except (Exception, SystemExit) as exc:      # noqa: BLE001 - the section's failure is its result
        fields = {"status": f"failed: {type(exc).__name__}: {exc}"[:2000]}
    return emit(name, seconds=round(time.perf_counter() - started, 1), **fields)


# -- the sections alone on the GPU --------------------------------------------------------------
def alone_config(check: bool, level: str, dtype: str, batch: int, *sets: str):
    return bench_config("tiny" if check else "imhn512", 64 if check else 512, batch, device_of(check).type,
                        SYNTHETIC / "train.h5", f"amp.opt_level={level}", f"amp.dtype={dtype}", *sets)


def section_first_step(check: bool) -> dict:
    """Per cuDNN benchmarking setting, a fresh process's seconds to its first step, and its first five."""
    rows = {"pid": os.getpid()}
    for benchmark in ("off", "on"):
        started = time.time()
        command = [sys.executable, __file__, "--first-steps", benchmark, *["--cpu-check"] * check]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        lines = done.stdout.strip().splitlines() or [done.stderr[-300:]]
        try:
            row = json.loads(lines[-1])
        except ValueError:
            return {"status": f"failed: benchmarking {benchmark}: exit {done.returncode}: {lines[-1][-300:]}"}
        row["to_first_step_s"] = round(row.pop("first_step_at") - started, 3)
        rows[f"cudnn_benchmark_{benchmark}"] = row
    return {"status": "ok", **rows}


def first_steps(check: bool, benchmark: bool) -> dict:
    """This process's import, CUDA start and build seconds, then its first five training steps."""
    device = device_of(check)
    tick = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    cuda_init = time.perf_counter() - tick
    tick = time.perf_counter()
    cfg = alone_config(check, "O1", "float16" if not check else "bfloat16", 2 if check else 16,
                       f"train.cudnn_benchmark={benchmark}")
    trainer, parts, dev = build_quietly(cfg)
    batch = next(synthetic_batches(cfg.train.batch_size, cfg, dev))
    sync(dev)
    row = {"pid": os.getpid(), "import_torch_s": round(_IMPORT_TORCH_S, 3),
           "import_all_s": round(_IMPORT_ALL_S, 3), "cuda_init_s": round(cuda_init, 3), "build_s": round(time.perf_counter() - tick, 3),
           "first_step_at": time.time(), "capture_step": None, "steps_s": []}
    graphed = getattr(trainer.net, "graphed", None)
    for k in range(5):
        tick = time.perf_counter()
        trainer.run_step([batch])
        sync(dev)
        row["steps_s"].append(round(time.perf_counter() - tick, 4))
        if graphed is not None and graphed.replay is not None and row["capture_step"] is None:
            row["capture_step"] = k + 1        # the step that captured the CUDA graphs
    return row


OLD = ["amp.cuda_graphs=false", "optim.fused=false"]     # the default before 2026-11-27
CANDIDATES = [  # name, level, dtype, batch, extra config
    ("O1 fp16 b16 (default: CUDA graphs, fused AdamW)", "O1", "float16", 16, []),
    ("O1 fp16 b16 eager, unfused (old default)", "O1", "float16", 16, OLD),
    ("O1 fp16 b16 eager, fused", "O1", "float16", 16, ["amp.cuda_graphs=false"]),
    ("O1 fp16 b16 graphs, unfused", "O1", "float16", 16, ["optim.fused=false"]),
    ("O1 bf16 b16", "O1", "bfloat16", 16, []),
    ("O2 fp16 b16", "O2", "float16", 16, []),
    ("O1 fp16 b32 (default)", "O1", "float16", 32, []),
    ("O1 fp16 b32 eager, unfused (old default)", "O1", "float16", 32, OLD),
    ("O2 fp16 b32", "O2", "float16", 32, []),
]


def section_throughput(check: bool) -> dict:
    """Alternating rounds per batch size, timed with CUDA events; out of memory: dropped, said."""
    rounds, steps = (1, 2) if check else (3, int(os.environ.get("SMOKE_STEPS", 30)))
    rows, errors = {}, {}
    for batch in sorted({c[3] for c in CANDIDATES}):
        group = [c for c in CANDIDATES if c[3] == batch and (not check or c[0] == "O1 bf16 b16")]
        if group:
            time_group(group, 2 if check else batch, rounds, steps, check, rows, errors)
    if CUDA and not check:
        rows["all_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
    return {"status": "ok" if set(errors) <= {"rounds"} else "partly failed", "steps_per_round": steps,
            "rows": rows, "errors": errors}


def time_group(group, batch, rounds, steps, check, rows, errors) -> None:
    built, times, skipped = {}, {}, {}
    for name, level, dtype, _, sets in group:
        try:
            cfg = alone_config(check, level, dtype, batch, *sets)
            trainer, parts, dev = build_quietly(cfg)
            data = synthetic_batches(batch, cfg, dev)
            for i in range(40):   # warm: cuDNN tuned, graphs captured, the fp16 loss scale settled
                if not trainer.run_step([next(data)]).skipped and i >= (1 if check else 6):
                    break
            sync(dev)
            built[name], times[name], skipped[name] = (trainer, data, dev), [], 0
        except Exception as exc:      # noqa: BLE001 - one candidate's failure, reported
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    for r in range(rounds):
        round_start = time.perf_counter()
        for name in list(built):
            trainer, data, dev = built[name]
            sync(dev)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if CUDA else (None, None)
            tick = time.perf_counter()
            try:
                if start is not None:
                    start.record()
                for _ in range(steps):
                    skipped[name] += trainer.run_step([next(data)]).skipped
                if start is not None:
                    end.record()
                    end.synchronize()
                times[name].append(start.elapsed_time(end) / steps if start is not None
                                   else (time.perf_counter() - tick) * 1e3 / steps)
            except torch.OutOfMemoryError as exc:
                errors[name] = f"OutOfMemoryError in round {r + 1}: {exc}"[:300]
                del built[name], trainer, data
                free_memory(dev)
        if r + 1 < rounds and left_s() < 1.2 * (time.perf_counter() - round_start) + 15:
            errors["rounds"] = f"stopped after {r + 1} round(s): the budget"
            break
    default = group[0][0] if times.get(group[0][0]) else None
    for name, ms in times.items():
        if not ms:
            continue
        rows[name] = {"ms_per_step_median": round(statistics.median(ms), 2),
                      "ms_per_step_min": round(min(ms), 2), "ms_per_step_max": round(max(ms), 2),
                      "images_per_s": round(batch * 1e3 / statistics.median(ms), 1),
                      "rounds": len(ms), "skipped_steps": skipped[name]}
        if default:
            rows[name][f"x_{default}"] = round(statistics.median(d / m for d, m in zip(times[default], ms)), 3)
    built.clear()
    free_memory(device_of(check))


def section_graph_numerics(check: bool) -> dict:
    """The largest relative differences of 12 steps' losses and weights, eager vs CUDA graphs."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    losses, weights = {}, {}
    for graphs in (False, True):
        cfg = alone_config(check, "O1", "bfloat16" if check else "float16", 4, f"data.input_size={64 if check else 128}",
                           f"amp.cuda_graphs={graphs and not check}", "train.cudnn_benchmark=false",
                           "train.seed=3")
        trainer, parts, dev = build_quietly(cfg)
        generator = torch.Generator(device="cpu").manual_seed(5)
        o = cfg.data.input_size // cfg.data.stride
        losses[graphs] = []
        for _ in range(3 if check else 12):
            images = torch.rand(4, 3, cfg.data.input_size, cfg.data.input_size, generator=generator).to(dev)
            target = (torch.rand(4, builtin("coco").num_channels, o, o, generator=generator) * 0.1).to(dev)
            losses[graphs].append(trainer.run_step([(images, target, torch.ones(4, 1, o, o, device=dev))]).loss)
        weights[graphs] = {k: v.float().clone() for k, v in parts.model.state_dict().items() if v.is_floating_point()}
        del trainer, parts
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    loss_diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses[False], losses[True]))
    weight_diff = max(((weights[False][k] - weights[True][k]).abs().max() / weights[False][k].abs().max().clamp_min(1e-12)).item()
                      for k in weights[False])
    return {"status": "ok", "steps": len(losses[True]), "max_rel_loss_diff": loss_diff, "max_rel_weight_diff": weight_diff,
            "eager_losses": [round(x, 5) for x in losses[False]], "graph_losses": [round(x, 5) for x in losses[True]]}


def section_evaluation(check: bool) -> dict:
    """Pictures/s of evaluation on coco80 (or coco4), and the ms of a picture by stage."""
    import numpy
    from bench.inference import split
    from inference.estimator import PoseEstimator
    from config.views import PredictSettings
    from data.h5format import KeypointH5
    from data.make_hdf5 import ConvertSettings, convert
    from inference.evaluation import decode_images, eval_mode
    from models import build_model

    source = ROOT / ".bench_data" / "coco80"
    ann = source / "person_keypoints_train2017.json"
    if not ann.is_file():
        source, ann = ROOT / "tests" / "data" / "coco4", ROOT / "tests" / "data" / "coco4" / "test_coco.json"
    device = device_of(check)
    cfg = build_config("tiny" if check else "imhn512", sets=["inference.scales=[1.0]", "inference.flip=true"])
    model = build_model(cfg.model, builtin("coco")).to(device)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        path = Path(tmp) / "val.h5"
        convert(ann, source, path, ConvertSettings(split="val", progress=False, max_images=2 if check else 0))
        h5 = KeypointH5(path)
        indices = list(range(h5.num_images)) * (1 if check else max(1, 80 // h5.num_images))
        rates = []
        with eval_mode(model):
            decode_images(model, h5, indices[:4], PredictSettings.of(cfg), device, progress=False)
            for _ in range(1 if check else 2):
                sync(device)
                tick = time.perf_counter()
                decode_images(model, h5, indices, PredictSettings.of(cfg), device, progress=False)
                sync(device)
                rates.append(len(indices) / (time.perf_counter() - tick))
        h5.close()
    truth = json.loads(ann.read_text())
    encoded = [numpy.fromfile(str(source / info["file_name"]), numpy.uint8) for info in truth["images"]]
    with eval_mode(model):                  # where a picture's time goes, by stage (bench/inference.py)
        stages = split(PoseEstimator(model, PredictSettings.of(cfg)), encoded[:2 if check else None], truth)
    return {"status": "ok", "pictures": len(indices), "source": source.name, "scales": [1.0], "flip": True,
            "pictures_per_s": [round(r, 2) for r in rates],
            "split_ms": {k: round(v, 2) for k, v in stages.items()}}


ALONE = {"first_step": section_first_step, "graph_numerics": section_graph_numerics,
         "throughput": section_throughput, "evaluation": section_evaluation}
SECTIONS = {**PARALLEL, **ALONE}


def environment(check: bool) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "python": sys.version.split()[0], "cpus": os.cpu_count(), "budget_s": BUDGET_S,
            "apex": apex_imports(), "nvcc": shutil.which("nvcc")}
    if CUDA and not check:
        info["device"] = torch.cuda.get_device_name(0)
        smi = shutil.which("nvidia-smi")
        if smi:
            info["driver"] = subprocess.run([smi, "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                                            capture_output=True, text=True).stdout.strip()
    return {"status": "ok", **info}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-check", action="store_true", help="every section on the CPU at toy sizes")
    parser.add_argument("--section", choices=[*SECTIONS])
    parser.add_argument("--only", help="comma-separated sections to run (default: all)")
    parser.add_argument("--first-steps", choices=("on", "off"), help=argparse.SUPPRESS)   # first_step's child
    args = parser.parse_args(argv)
    if args.first_steps:
        print(json.dumps(first_steps(args.cpu_check, args.first_steps == "on")), flush=True)
        return 0
    only = set(args.only.split(",")) if args.only else None
    if only and (unknown := sorted(only - SECTIONS.keys())):
        parser.error(f"--only: no section {unknown}")
    if args.section:
        return run_one(args.section, args.cpu_check)
    if not CUDA and not args.cpu_check:
        print("error: no CUDA GPU here: use python bench/gpu_smoke.py --cpu-check", file=sys.stderr)
        return 2
    logs = Path(os.environ.get("OUT", "bench_out")) / "smoke"
    logs.mkdir(parents=True, exist_ok=True)
    from data.synthetic import ensure_synthetic_h5      # drawn once, before the sections share it
    with contextlib.redirect_stdout(io.StringIO()):
        ensure_synthetic_h5(SYNTHETIC)
    lines = [emit("env", **environment(args.cpu_check))]
    alone = [n for n in ALONE if not only or n in only]
    lines += run_side_by_side([n for n in PARALLEL if not only or n in only], args.cpu_check, logs, len(alone))
    for name in alone:
        if left_s() < 20:
            lines.append(emit(name, status="skipped: the budget"))
            continue
        lines.append(timed(name, args.cpu_check))
        free_memory(device_of(args.cpu_check))
    print(f"\n{'section':<16} {'seconds':>8}  status")
    for line in lines:
        print(f"{line['section']:<16} {line.get('seconds') or '-':>8}  {str(line.get('status'))[:100]}")
    (logs / "sections.jsonl").write_text("".join(json.dumps(line, default=str) + "\n" for line in lines))
    return 0 if all(str(ln.get("status", "")).startswith(("ok", "skipped")) for ln in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
