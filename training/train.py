"""`capsnet train`: Adam with a learning-rate schedule (exponential decay per epoch, or a linear warmup and
decay to zero per step), random-shift augmentation, validation after every epoch, and the best and the last
checkpoints.

The best checkpoint is chosen on a validation split held out of the training images (`--val-fraction`);
the test split is scored after every epoch for the report and never takes part in the choice.

The same code runs as one process or as N under torchrun: the model is wrapped in
DistributedDataParallel, a DistributedSampler gives each rank its share of every epoch, and only
rank 0 prints and writes files. `--batch-size` is the global batch, split evenly across ranks.
Every random choice derives from `--seed` and the epoch, so `--resume` continues the same run: from
the last epoch's end, or with `--checkpoint-every N` from the last N-step mark inside an epoch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from capsnet.errors import CapsNetError
from capsnet.models.checkpoint import Checkpoint, load_checkpoint
from capsnet.runtime.cpu import bf16_on_this_cpu
from capsnet.training import distributed
from capsnet.training.checkpoint import remove_leftover_temporaries, save_checkpoint
from capsnet.training.data import load_dataset
from capsnet.training.distributed import DistributedContext
from capsnet.training.epoch import autocast_context, epoch_steps, train_one_epoch
from capsnet.training.evaluate import Evaluation, Scoring, check_dataset_fits, evaluate
from capsnet.training.history import EpochRecord, SplitScore
from capsnet.training.options import RunOptions, TrainOptions, last_checkpoint_path, model_config
from capsnet.training.resume import (EpochProgress, batch_plan, check_linear_schedule_steps, check_resumable,
                                     learning_rate_options, run_options)
from capsnet.training.run import EpochResult, Run, Training, new_state, restore, run_info, snapshot, step_model_for


def announce(context: DistributedContext, message: str) -> None:
    """Progress lines come from rank 0 only."""
    if context.is_main:
        print(message, flush=True)


def prepare_output(out: Path, context: DistributedContext) -> None:
    """Fail before training, not after the first epoch, if the checkpoint cannot be written; clear what an
    earlier run killed while saving left."""
    if out.is_dir():
        raise CapsNetError(f"--out {out} is a directory; give a file name such as {out / 'model.ckpt'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CapsNetError(f"cannot create the folder for --out {out}: {err.strerror or err}") from None
    try:  # a real write: os.access says yes to root even where nothing can be created (/proc)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as err:
        raise CapsNetError(f"cannot write to {out.parent}: {err.strerror or err}") from None
    if context.is_main:  # the rank that saves
        for leftover in (*remove_leftover_temporaries(out), *remove_leftover_temporaries(last_checkpoint_path(out))):
            announce(context, f"removed {leftover}, left by a run killed while saving")


def use_transparent_huge_pages(environ: MutableMapping[str, str] = os.environ) -> None:
    """Ask torch's CPU allocator for transparent huge pages under its buffers of 2 MiB and more.

    A training step frees its large buffers and maps them again the next step, page by page; with 2 MiB pages it
    takes 512 times fewer faults (PyTorch's CPU tuning recipe; measured in docs/experiments/README.md, "Capacity
    on a GPU, and memory on a CPU"). Freed memory still goes back to the system. c10 reads the variable at its
    first CPU allocation, so this acts only before one, as in `capsnet train`; a value the user set is kept (0
    turns it off).
    """
    environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def train(options: TrainOptions) -> Checkpoint:
    """Train, validate after each epoch, write the best (`options.out`) and last checkpoints; return the last."""
    use_transparent_huge_pages()
    context = distributed.context_from_environment()
    device = distributed.resolve_device(options.device, context)
    threads = None
    if device.type == "cpu" and (options.threads or context.local_world_size > 1):
        # The processes on one machine share its cores.
        threads = options.threads or max(1, (os.cpu_count() or 1) // context.local_world_size)
    with torch_threads(threads), distributed.process_group(context, device):
        # the ranks check together: a mistake on any of them stops every one, with one line from rank 0
        with distributed.errors_reported_once(context):
            run = prepare_run(options, context, device)
        if context.is_distributed:  # each rank read its own copy of the data and checkpoint
            with distributed.errors_reported_once(context):
                distributed.check_same_on_every_rank(context, "data or checkpoints", run_fingerprint(run))
        return run_epochs(run)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's CPU threads set to `count` (None: left as they are) for the run, and given back after it: the
    setting is the process's, and a caller that trains in its own process (a test, a script) keeps its own."""
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def prepare_run(options: TrainOptions, context: DistributedContext, device: torch.device) -> Run:
    """Check the user's input against the data and the resumed checkpoint; return the run: the options completed
    from them, the model config, the data, the resumed checkpoint and how far into its next epoch it got."""
    if options.batch_size % context.world_size:
        raise CapsNetError(f"--batch-size {options.batch_size} is not divisible by the {context.world_size} processes")
    if options.amp and device.type == "cpu":
        native, why = bf16_on_this_cpu()
        if not native:
            announce(context, f"--amp: training in fp32: {why}; emulated bf16 is many times slower than fp32")
            options = replace(options, amp=False)
    prepare_output(options.out, context)
    resumed = load_checkpoint(options.resume) if options.resume is not None else None
    drawn = run_options(options, resumed)
    dataset = load_dataset(options.data, drawn["val_fraction"])
    if drawn["max_shift"] >= min(dataset.image_shape[1:]):
        raise CapsNetError(f"--max-shift {drawn['max_shift']} is not smaller than the {dataset.image_shape[1]}x"
                           f"{dataset.image_shape[2]} images")
    config = model_config(options, dataset, resumed.config if resumed else None)
    completed = RunOptions.completed(options, {**drawn, **learning_rate_options(options, config.arch, resumed)})
    progress = EpochProgress()
    if resumed is not None:
        # the model keeps its classes, each by its name: not clothes for digits, nor only some digits
        check_dataset_fits(resumed.config, dataset, f"checkpoint {completed.resume}", tuple(resumed.class_names),
                           every_class=True)
        plan = batch_plan(completed, context.world_size, len(dataset.train))
        progress = check_resumable(resumed, config, completed, plan)
        check_linear_schedule_steps(resumed, completed, progress, plan,
                                    epoch_steps(len(dataset.train), completed.batch_size, context))
    check_dataset_fits(config, dataset, "the model")
    return Run(completed, config, dataset, context, device, resumed, progress)


def run_fingerprint(run: Run) -> dict[str, object]:
    """What every rank must have alike: the splits (sizes, classes, pixels) and the resumed run (where it stopped, its
    weights: DDP makes the ranks' weights equal once, and ranks with other optimizer states would drift apart)."""
    dataset, resumed = run.dataset, run.resumed
    splits = (dataset.train, dataset.validation, dataset.test)
    pixels, weights = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
    for split in splits:  # .data: the arrays' bytes, as a buffer the type checker knows
        if split is not None:
            pixels.update(np.ascontiguousarray(split.images).data)
            pixels.update(np.ascontiguousarray(split.labels).data)
    for name, tensor in sorted(resumed.state_dict.items() if resumed else ()):
        weights.update(name.encode())
        weights.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return {"training/validation/test images": "/".join(str(len(split or ())) for split in splits),
            "classes": ", ".join(dataset.class_names), "image shape": "x".join(map(str, dataset.image_shape)),
            "images' content hash": pixels.hexdigest(),
            "resumed epoch and step": f"{resumed.epoch if resumed else 0}, {run.start.step}",
            "resumed weights' hash": weights.hexdigest()}


def start_training(run: Run) -> Training:
    """The run's model, optimizer and schedule: new, or the resumed checkpoint's."""
    state = new_state(run, epoch_steps(len(run.dataset.train), run.options.batch_size, run.context))
    if run.resumed is not None:
        restore(state, run)
    return Training(run, state, step_model_for(state.model, run), run_info(run, state.model),
                    batch_plan(run.options, run.context.world_size, len(run.dataset.train)))


def best_epoch(history: list[EpochRecord]) -> EpochRecord | None:
    """The best epoch by validation accuracy (the earliest of equals); without a validation split every epoch is."""
    return max(history, key=lambda record: record.validation.accuracy if record.validation else -1.0, default=None)


def is_new_best(scored: dict[str, Evaluation], best: EpochRecord | None, out: Path) -> bool:
    """Whether an epoch scored so replaces the best one (`out`): selection sees the validation split only, the test
    split is reported."""
    return ("validation" not in scored or best is None or best.validation is None
            or scored["validation"].accuracy > best.validation.accuracy or not out.exists())


def score(training: Training) -> dict[str, Evaluation]:
    """The model on the validation split (where there is one) and the test split."""
    run = training.run
    scoring = Scoring(run.per_rank_batch, run.device, run.context, autocast_context(run.device, run.options.amp))
    splits = (("validation", run.dataset.validation), ("test", run.dataset.test))
    return {name: evaluate(training.state.model, split, run.dataset.class_names, scoring)
            for name, split in splits if split is not None}


def epoch_record(epoch: int, lr: float, trained: EpochResult, scored: dict[str, Evaluation],
                 eval_seconds: float) -> EpochRecord:
    """One epoch's line of the history: its rate, its training figures and its scores."""
    scores = {name: SplitScore(result.loss, result.accuracy) for name, result in scored.items()}
    return EpochRecord(epoch + 1, lr, trained.loss, trained.accuracy, validation=scores.get("validation"),
                       test=scores.get("test"), train_seconds=trained.seconds,
                       train_images_per_second=trained.images / trained.seconds, eval_seconds=eval_seconds)


def run_epochs(run: Run) -> Checkpoint:
    """Train from the start, or from `run.resumed` and `run.start` into its next epoch, up to `options.epochs`; save
    the last and the best epoch after each one, and return the last epoch's checkpoint."""
    options, context, dataset = run.options, run.context, run.dataset
    training = start_training(run)
    state = training.state
    best = best_epoch(state.history)
    processes = f"{context.world_size} process{'es' if context.is_distributed else ''}"
    announce(context, f"training {training.info['parameters']:,} parameters on {len(dataset.train):,} images of "
                      f"{dataset.name} ({run.device}, {processes})")
    start_epoch = run.resumed.epoch if run.resumed else 0
    progress = run.start
    if progress.step:
        announce(context, f"resuming epoch {start_epoch + 1} after step {progress.step}")
    checkpoint = run.resumed

    def save_progress(epoch: int, partial: EpochProgress) -> None:
        if context.is_main:  # weights are the same on every rank
            save_checkpoint(snapshot(training, epoch, {**training.info, "steps_into_epoch": partial.step}, partial),
                            options.last_path)

    for epoch in range(start_epoch, options.epochs):
        lr = state.optimizer.param_groups[0]["lr"]
        trained = train_one_epoch(training, epoch, progress, save_progress)
        progress = EpochProgress()
        if options.lr_schedule == "exponential":
            state.scheduler.step()
        started = time.perf_counter()
        scored = score(training)
        record = epoch_record(epoch, lr, trained, scored, time.perf_counter() - started)
        state.history.append(record)
        is_best = is_new_best(scored, best, options.out)
        if is_best:
            best = record
        per_class = {f"{name}_per_class_accuracy": result.per_class_accuracy for name, result in scored.items()}
        checkpoint = snapshot(training, epoch + 1, {**record.to_dict(), **training.info, **per_class})
        if context.is_main:
            save_checkpoint(checkpoint, options.last_path)
            if is_best:
                save_checkpoint(checkpoint, options.out)
        figures = " | ".join(f"{name} loss {result.loss:.4f} acc {100 * result.accuracy:.2f}%"
                             for name, result in scored.items())
        announce(context, f"epoch {epoch + 1}/{options.epochs}: "
                          f"train loss {trained.loss:.4f} acc {100 * trained.accuracy:.2f}% | {figures} | "
                          f"{record.train_images_per_second:.0f} images/s, {trained.seconds:.1f}s"
                          + (f" | best -> {options.out}" if is_best and "validation" in scored else ""))
    # check_resumable left at least one epoch to train
    assert checkpoint is not None and best is not None
    announce_selection(best, run)
    return checkpoint


def announce_selection(best: EpochRecord, run: Run) -> None:
    """Which epoch `options.out` holds, and why."""
    assert best.test is not None  # an epoch of this run (is_new_best), which scores the test split
    options = run.options
    if best.validation is None:
        announce(run.context, f"no validation split (--val-fraction 0), so no selection: {options.out} holds the "
                              f"last epoch (test accuracy {100 * best.test.accuracy:.2f}%)")
    else:
        announce(run.context, f"best validation accuracy {100 * best.validation.accuracy:.2f}% after epoch "
                              f"{best.epoch} (its test accuracy, not used to choose: "
                              f"{100 * best.test.accuracy:.2f}%): {options.out}; last epoch: {options.last_path}")
