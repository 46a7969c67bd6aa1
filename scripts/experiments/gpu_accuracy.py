"""The accuracy runs that need a GPU, side by side on one device within a fixed time, chosen on validation.

Three families (--families), two runs each, all six at once:
    mnist-paper    full MNIST, the `paper` preset with the paper's ±2-pixel shifts, seeds 0 and 1
    mnist-em       full MNIST, EM routing (`--arch em`), seeds 0 and 1 with linear schedules of two lengths
    fashion-paper  Fashion-MNIST, the `paper` preset with leaky routing and flips, shifts of 2 and of 4 pixels
Every run holds out 5,000 training images as its validation split and keeps its best epoch by validation
accuracy; the run of each family with the higher best validation accuracy is chosen, and its test accuracy is
read once, for the report. Runs still going at the training deadline are stopped; their best checkpoint so
far stands and the results say so. Then each chosen checkpoint is exported (`capsnet export --int8`: ONNX FP32
and INT8, checked against PyTorch, INT8's accuracy measured on the test split).

--budget is the whole script, start to last file: training stops --export-seconds before its end, and an
export still going at the end is stopped. Data: --data-root holds mnist/ and fashion-mnist/ (IDX files, as
gzip or not), an ignored folder of the checkout (`.data/`), for a GPU host that receives only a copy of the checkout.

Writes to --out only files of at most 15 MiB (so that a host that returns files up to 16 MiB returns all of them):
    results.json            every run's epochs, the choice per family, the exports, the machine, the timings
    <family>.ckpt.NN        the chosen checkpoint without optimiser state, split; rejoin: cat <family>.ckpt.* > F
    onnx/<family>/...       `capsnet export`'s directory but its model.ckpt (the checkpoint above: rejoin it there
                            to serve); a file over 15 MiB as FILE.NN parts, rejoined the same way
    logs.tar.gz             every run's and export's log
and the full checkpoints and logs to --work.

    python scripts/experiments/gpu_accuracy.py --data-root .data --out "$OUT"   # 570 s in all
    # every step on a CPU: tiny models, the embedded digits for every family, one epoch
    python scripts/experiments/gpu_accuracy.py --cpu-dry-run --out /tmp/gpu-accuracy
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from capsnet.export.cli import EXIT_REFUSED

PART_BYTES = 15 * 2**20
# 5,000 of the 60,000 training images, the split the public re-implementations report on
VAL_FRACTION = "0.08333333"
FAMILIES = ("mnist-paper", "mnist-em", "fashion-paper")


@dataclass
class Job:
    """One child process: a training run or an export, with its log."""

    name: str
    command: list[str]
    log: Path
    process: subprocess.Popen | None = None
    stopped_at_deadline: bool = False

    def start(self, threads: str, cwd: Path) -> None:
        # torch.compile's workers too take the job's share of the cores, not one process per core each
        environment = dict(os.environ, OMP_NUM_THREADS=threads, TORCHINDUCTOR_COMPILE_THREADS=threads)
        with self.log.open("w") as log:
            log.write(" ".join(self.command) + "\n")
            log.flush()
            # outside the checkout, whose bare capsnet/ folder would shadow a package tree on PYTHONPATH
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            cwd=cwd, start_new_session=True)


@dataclass
class Run:
    name: str
    family: str
    data: str
    flags: list[str]
    job: Job | None = field(default=None, init=False)
    checkpoint: Path = field(init=False)


def plan(data_root: Path, dry_run: bool) -> list[Run]:
    mnist = "embedded" if dry_run else str(data_root / "mnist")
    fashion = "embedded" if dry_run else str(data_root / "fashion-mnist")
    paper = "tiny" if dry_run else "paper"
    compiled = [] if dry_run else ["--compile"]
    # Sizes for 6 runs sharing one H100 for the default 450 s of training. Compiled `paper` runs did 3,100-5,600
    # images/s each when four or five shared an H100: 11-17 s an epoch of 55,000 images (docs/experiments). The
    # exponential decay makes any stopping epoch a finished schedule: the `paper` runs plan 30 epochs and stop
    # where the deadline finds them. EM's rate falls linearly to 0 at its last planned epoch, so its two seeds
    # take two lengths: 3 epochs end in time at 400 images/s (what a CPU-starved EM run did), 6 at 800.
    epochs = {"paper": "1", "em": ("1", "1"), "fashion": "1"} if dry_run else {"paper": "30", "em": ("3", "6"),
                                                                              "fashion": "30"}
    runs = []
    for seed in (0, 1):
        runs.append(Run(f"mnist-paper-seed{seed}", "mnist-paper", mnist,
                        ["--preset", paper, "--batch-size", "128", "--epochs", epochs["paper"], "--max-shift", "2",
                         *compiled, "--seed", str(seed)]))
        runs.append(Run(f"mnist-em-seed{seed}", "mnist-em", mnist,
                        ["--arch", "em", "--preset", "em-tiny" if dry_run else "em", "--batch-size", "64",
                         "--epochs", epochs["em"][seed], "--seed", str(seed)]))
    # Fashion-MNIST: the settings chosen on validation before (leaky routing, flips, shifts of 2) with their decay
    # compressed into 30 epochs (0.001 × 0.9^30 ≈ 4e-5, where the 80-epoch run ended), beside the one lever of
    # the three not yet ranked that costs nothing in time: shifts of up to 4 pixels.
    for shift in (2, 4):
        runs.append(Run(f"fashion-paper-shift{shift}", "fashion-paper", fashion,
                        ["--preset", paper, "--routing", "leaky", "--hflip", "--batch-size", "64", "--lr", "0.001",
                         "--lr-decay", "0.9", "--epochs", epochs["fashion"], "--max-shift", str(shift), *compiled,
                         "--seed", "0"]))
    return runs


def machine(device: str) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
            "cpus": os.cpu_count()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def share_of_cores(jobs: int) -> str:
    # Each run shifts its batches and launches its kernels from the CPU; with torch's default of every core per
    # process, four runs and their compile workers oversubscribed 16 cores and fed an H100 at under 900 images/s
    # a run.
    return str(max(1, (os.cpu_count() or 1) // jobs))


def run_until(jobs: list[Job], deadline: float, cwd: Path) -> None:
    """Start every job in `cwd` with its share of the cores, wait until all end or the deadline passes, then stop
    those still going."""
    threads = share_of_cores(len(jobs))
    for job in jobs:
        job.start(threads, cwd)
    while time.monotonic() < deadline and any(job.process.poll() is None for job in jobs):
        time.sleep(2)
    for job in jobs:
        if job.process.poll() is None:
            job.stopped_at_deadline = True
            os.killpg(job.process.pid, signal.SIGTERM)
    for job in jobs:
        try:
            job.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait()


def train_all(runs: list[Run], work: Path, device: str, deadline: float) -> None:
    threads = share_of_cores(len(runs))  # --threads too: train sets torch's threads from it, not the environment
    for run in runs:
        run.checkpoint = work / "checkpoints" / f"{run.name}.ckpt"
        run.job = Job(run.name, [sys.executable, "-m", "capsnet", "train", "--data", run.data, *run.flags,
                                 "--val-fraction", VAL_FRACTION, "--device", device, "--threads", threads,
                                 "--no-progress", "--out", str(run.checkpoint)],
                      work / "logs" / f"{run.name}.log")
    run_until([run.job for run in runs], deadline, work)


def split_into_parts(source: Path, destination: Path) -> list[str]:
    """Copy `source` to `destination` whole if it is at most PART_BYTES, else as destination.NN parts."""
    data = source.read_bytes()
    if len(data) <= PART_BYTES:
        shutil.copyfile(source, destination)
        return [destination.name]
    names = []
    for index, start in enumerate(range(0, len(data), PART_BYTES)):
        part = destination.with_name(f"{destination.name}.{index:02d}")
        part.write_bytes(data[start:start + PART_BYTES])
        names.append(part.name)
    return names


def summarise(runs: list[Run], out: Path, work: Path) -> dict:
    from capsnet.models.checkpoint import load_checkpoint
    from capsnet.training.checkpoint import save_checkpoint

    results = {"validation_fraction": float(VAL_FRACTION), "runs": {}, "chosen": {}}
    for run in runs:
        entry = {"flags": ["--data", run.data, *run.flags], "exit_code": run.job.process.returncode,
                 "stopped_at_deadline": run.job.stopped_at_deadline}
        if run.checkpoint.exists():
            checkpoint = load_checkpoint(run.checkpoint)
            entry.update(best_epoch=checkpoint.epoch, epochs_done=len(checkpoint.history), history=checkpoint.history,
                         best_validation_accuracy=checkpoint.metrics.get("validation_accuracy"),
                         its_test_accuracy=checkpoint.metrics.get("test_accuracy"),
                         parameters=checkpoint.metrics.get("parameters"))
        results["runs"][run.name] = entry
    for family in FAMILIES:
        done = [run for run in runs if run.family == family and "best_validation_accuracy" in results["runs"][run.name]]
        if not done:
            continue
        chosen = max(done, key=lambda run: results["runs"][run.name]["best_validation_accuracy"])
        record = results["runs"][chosen.name]
        checkpoint = load_checkpoint(chosen.checkpoint)
        checkpoint.optimizer_state = checkpoint.scheduler_state = checkpoint.scaler_state = None
        weights_only = work / "checkpoints" / f"{family}.ckpt"
        save_checkpoint(checkpoint, weights_only)
        # always as parts, so that one command rejoins every family's checkpoint
        parts = split_into_parts(weights_only, out / f"{family}.ckpt.00")
        results["chosen"][family] = {"run": chosen.name, "data": chosen.data, "epoch": record["best_epoch"],
                                     "validation_accuracy": record["best_validation_accuracy"],
                                     "test_accuracy": record["its_test_accuracy"], "checkpoint": str(weights_only),
                                     "parts": parts}
    return results


def export_chosen(results: dict, out: Path, work: Path, deadline: float) -> None:
    """`capsnet export --int8` of every chosen checkpoint, side by side, then every file into --out, split."""
    chosen = results["chosen"]
    jobs = {family: Job(f"export-{family}",
                        [sys.executable, "-m", "capsnet", "export", entry["checkpoint"], "--out",
                         str(work / "onnx" / family), "--data", entry["data"], "--int8"],
                        work / "logs" / f"export-{family}.log") for family, entry in chosen.items()}
    run_until(list(jobs.values()), deadline, work)
    for family, job in jobs.items():
        directory = work / "onnx" / family
        record = {"exit_code": job.process.returncode, "stopped_at_deadline": job.stopped_at_deadline, "files": []}
        if job.process.returncode in (0, EXIT_REFUSED):  # written; with a refused INT8, without it
            (out / "onnx" / family).mkdir(parents=True, exist_ok=True)
            # the export's model.ckpt is a copy of the chosen checkpoint, returned once already as its parts
            for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "model.ckpt"):
                target = out / "onnx" / family / path.relative_to(directory)
                target.parent.mkdir(parents=True, exist_ok=True)
                record["files"] += [str(Path(family) / path.relative_to(directory).parent / name)
                                    for name in split_into_parts(path, target)]
            sidecar = directory / "model.json"
            if sidecar.exists():
                description = json.loads(sidecar.read_text())
                record["int8"] = description.get("int8")
                record["refused"] = description.get("refused", {})
        chosen[family]["export"] = record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, default=Path(".data"),
                        help="folder holding mnist/ and fashion-mnist/ (IDX files)")
    parser.add_argument("--out", type=Path, required=True, help="the files to return, each at most 15 MiB")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-accuracy-work"),
                        help="full checkpoints, logs and exports (default: /tmp/gpu-accuracy-work)")
    # one command under a 600-s limit, with time to spare
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole script (default 570)")
    parser.add_argument("--export-seconds", type=float, default=120,
                        help="seconds kept at the end for summary and exports (default 120)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES),
                        help="which families run (default: all three; fewer runs each get more of the GPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="tiny models on the embedded digits for one epoch on the CPU: every step, no figure")
    args = parser.parse_args()
    started = time.monotonic()
    # the jobs run in --work, so every path they are given is absolute
    args.data_root, args.out, args.work = args.data_root.resolve(), args.out.resolve(), args.work.resolve()
    device = "cpu" if args.cpu_dry_run else args.device
    if not args.cpu_dry_run:
        for name in {"fashion-mnist" if family.startswith("fashion") else "mnist" for family in args.families}:
            if not (args.data_root / name).is_dir():
                parser.error(f"{args.data_root / name} holds no IDX files")
    if args.export_seconds >= args.budget:
        parser.error("--export-seconds must be below --budget")
    for folder in (args.out, args.work / "logs", args.work / "checkpoints"):
        folder.mkdir(parents=True, exist_ok=True)
    runs = [run for run in plan(args.data_root, args.cpu_dry_run) if run.family in args.families]
    info = machine(device)
    train_all(runs, args.work, device, started + args.budget - args.export_seconds)
    trained = time.monotonic()
    results = summarise(runs, args.out, args.work)
    export_chosen(results, args.out, args.work, started + args.budget)
    results.update(machine=info, budget_seconds=args.budget, export_seconds=args.export_seconds,
                   threads_per_run=int(share_of_cores(len(runs))),
                   training_wall_seconds=round(trained - started, 1),
                   wall_seconds=round(time.monotonic() - started, 1))
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as archive:
        archive.add(args.work / "logs", arcname="logs")
    for name, run in results["runs"].items():
        print(f"{name}: exit {run['exit_code']}{' (stopped at the deadline)' if run['stopped_at_deadline'] else ''}, "
              f"{run.get('epochs_done', 0)} epochs, best validation {run.get('best_validation_accuracy')} "
              f"(epoch {run.get('best_epoch')}), its test {run.get('its_test_accuracy')}")
    for family, entry in results["chosen"].items():
        export = entry.get("export", {})
        print(f"chosen {family}: {entry['run']} epoch {entry['epoch']}, validation {entry['validation_accuracy']}, "
              f"test {entry['test_accuracy']}; export exit {export.get('exit_code')}, int8 {export.get('int8')}")
    print(f"wall {results['wall_seconds']} s (training {results['training_wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
