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
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from capsnet.runtime.cpu import MAX_THREADS, bf16_on_this_cpu
from capsnet.errors import CapsNetError
from capsnet.training import distributed
from capsnet.models.checkpoint import Checkpoint, Model, create_model, load_checkpoint
from capsnet.training.checkpoint import remove_leftover_temporaries, save_checkpoint
from capsnet.models.config import PRESETS, CapsNetConfig, preset
from capsnet.training.data import (Augmentation, Dataset, Split, channel_mean_std, data_location, load_dataset,
                                   to_float)
from capsnet.training.distributed import DistributedContext
from capsnet.training.evaluate import Evaluation, check_dataset_fits, evaluate
from capsnet.training.history import EpochRecord, SplitScore
from capsnet.training.loss import capsnet_loss
from capsnet.training.optimizer import parameter_groups
from capsnet.models.capsnet import count_parameters
from capsnet.training.resume import (LR_SCHEDULES, MODEL_FLAGS, EpochProgress, batch_plan, check_linear_schedule_steps,
                                     check_resumable, default, learning_rate_options, run_options)


DYNAMIC_ROUTING_FLAGS = ("routing", "squash_constant", "detach_agreement")
# Routing flags an architecture has no such setting for, with why: refused, not silently ignored.
REFUSED_ROUTING_FLAGS = {
    "em": (DYNAMIC_ROUTING_FLAGS, "sets dynamic routing; EM routing (--arch em) has no such setting"),
    "gap-cnn": ((*DYNAMIC_ROUTING_FLAGS, "routing_iterations"),
                "sets capsule routing; a gap-cnn model has no capsules"),
}
# The architectures of the presets each --arch takes (the CNN baseline takes its input size from a fixed-size
# capsule preset, the any-size models have presets of their own).
PRESET_ARCHITECTURES = {"capsnet": ("capsnet",), "em": ("em",), "cnn-baseline": ("capsnet", "em"),
                        "shared-capsnet": ("shared-capsnet",), "gap-cnn": ("gap-cnn",)}
SEED_LIMIT = 2**63  # torch.manual_seed and numpy's SeedSequence both take 0 .. 2**63 - 1


@dataclass
class TrainOptions:
    """A run's settings; None: not given, so the resumed checkpoint's or the default (resume.SETTINGS)."""
    data: str = default("data")
    out: Path = Path(default("out"))
    # model: None keeps the preset's (or, with --resume, the checkpoint's)
    preset: str | None = None
    arch: str | None = None
    routing: str | None = None
    routing_iterations: int | None = None
    squash_constant: float | None = None
    reconstruction_weight: float | None = None
    detach_agreement: bool | None = None
    normalize: bool = default("normalize")  # standardise inputs with the training split's per-channel mean/std
    val_fraction: float | None = None  # share of the training images held out to choose the best epoch; 0: none
    # optimisation
    epochs: int = default("epochs")
    batch_size: int = default("batch_size")
    lr: float | None = None
    lr_schedule: str | None = None
    lr_decay: float | None = None  # exponential: multiplies the learning rate after every epoch
    warmup: float | None = None  # linear: share of the steps the rate rises over
    # the batches and their draws
    max_shift: int | None = None
    hflip: bool | None = None  # random left-right mirror (clothes, not digits)
    erase: float | None = None  # probability of random erasing per image
    seed: int | None = None
    # execution
    device: str = default("device")
    amp: bool = default("amp")  # fp16 autocast + gradient scaling on CUDA, bf16 autocast on a CPU with native bf16
    compile: bool = default("compile")
    threads: int | None = default("threads")
    resume: Path | None = None
    checkpoint_every: int | None = default("checkpoint_every")  # also write the last checkpoint every N steps
    progress: bool = True

    def __post_init__(self) -> None:
        checks = {
            # Path() would drop the separator, and the checkpoint would become a file named like the folder
            f"--out {self.out} names a folder; give a file name such as {Path(self.out) / 'model.ckpt'}":
                not str(self.out).endswith(os.sep),
            "--epochs must be at least 1": self.epochs >= 1,
            "--val-fraction must be at least 0 and below 1": self.val_fraction is None or 0 <= self.val_fraction < 1,
            "--batch-size must be at least 1": self.batch_size >= 1,
            "--lr must be a positive number": self.lr is None or (self.lr > 0 and np.isfinite(self.lr)),
            "--lr-schedule must be exponential or linear": self.lr_schedule in (None, *LR_SCHEDULES),
            "--lr-decay must be in (0, 1]": self.lr_decay is None or 0 < self.lr_decay <= 1,
            "--warmup must be at least 0 and below 1": self.warmup is None or 0 <= self.warmup < 1,
            "--max-shift must be 0 or more": self.max_shift is None or self.max_shift >= 0,
            "--erase must be in [0, 1]": self.erase is None or 0 <= self.erase <= 1,
            "--threads must be at least 1": self.threads is None or self.threads >= 1,
            f"--threads must be at most {MAX_THREADS}": self.threads is None or self.threads <= MAX_THREADS,
            "--checkpoint-every must be at least 1": self.checkpoint_every is None or self.checkpoint_every >= 1,
            "--routing-iterations must be at least 1": self.routing_iterations is None or self.routing_iterations >= 1,
            "--squash-constant must be a positive number": self.squash_constant is None or (
                self.squash_constant > 0 and np.isfinite(self.squash_constant)),
            f"--seed must be in [0, {SEED_LIMIT})": self.seed is None or 0 <= self.seed < SEED_LIMIT,
            "--reconstruction-weight must be 0 or more": self.reconstruction_weight is None or (
                self.reconstruction_weight >= 0 and np.isfinite(self.reconstruction_weight)),
        }
        for message, ok in checks.items():
            if not ok:
                raise CapsNetError(message)
        self.out = Path(self.out)
        self.resume = None if self.resume is None else Path(self.resume)


@dataclass(frozen=True)
class RunOptions:
    """The settings a run trains with: TrainOptions completed from the resumed checkpoint and the defaults
    (resume.run_options, resume.learning_rate_options), so none is left "not given"."""
    data: str
    out: Path
    resume: Path | None
    val_fraction: float
    epochs: int
    batch_size: int
    lr: float
    lr_schedule: str
    lr_decay: float | None  # the exponential schedule's; None under the linear one
    warmup: float | None  # the linear schedule's; None under the exponential one
    max_shift: int
    hflip: bool
    erase: float
    seed: int
    amp: bool
    compile: bool
    checkpoint_every: int | None
    progress: bool

    @classmethod
    def completed(cls, options: TrainOptions, resolved: dict[str, Any]) -> RunOptions:
        """`options`, with the settings the run resolved from the checkpoint and the defaults in place of its own."""
        given = {setting.name: getattr(options, setting.name) for setting in fields(cls)}
        return cls(**{**given, **resolved})

    @property
    def last_path(self) -> Path:
        return last_checkpoint_path(self.out)


def last_checkpoint_path(out: Path) -> Path:
    """The last epoch's checkpoint, next to the best one: model.ckpt -> model.last.ckpt."""
    return out.with_name(f"{out.stem}.last.ckpt")


def model_config(options: TrainOptions, dataset: Dataset, base: CapsNetConfig | None) -> CapsNetConfig:
    """The preset sized for the data, with the model flags applied; `base` (a resumed model) replaces the preset."""
    channels, height, width = dataset.image_shape
    if options.preset is not None or base is None:
        base = preset(options.preset or default("preset").of(options.arch), in_channels=channels, height=height,
                      width=width, num_classes=len(dataset.class_names))
        if options.arch is not None and base.arch not in PRESET_ARCHITECTURES[options.arch]:
            names = [name for name, config in PRESETS.items() if config.arch in PRESET_ARCHITECTURES[options.arch]]
            raise CapsNetError(f"--preset {options.preset} is a {base.arch} preset; --arch {options.arch} takes "
                               f"{' or '.join(names)}")
    changes = {name: getattr(options, name) for name in MODEL_FLAGS
               if getattr(options, name) is not None}
    refused, why = REFUSED_ROUTING_FLAGS.get(changes.get("arch") or base.arch, ((), ""))
    given = [name for name in refused if name in changes]
    if given:
        raise CapsNetError(f"--{given[0].replace('_', '-')} {why}")
    if changes.get("arch") == "cnn-baseline":
        changes["reconstruction_weight"] = 0.0  # the baseline has no decoder: margin loss only
    if options.normalize:
        changes["input_mean"], changes["input_std"] = channel_mean_std(dataset.train.images)
    return base.replace(**changes)


def epoch_batches(num_images: int, batch_size: int, context: DistributedContext, seed: int,
                  epoch: int) -> list[np.ndarray]:
    """This rank's shuffled share of the epoch, cut into batches; every rank gets the same number of batches."""
    # the sampler asks its dataset for nothing but its length
    sampler: DistributedSampler[int] = DistributedSampler(
        range(num_images), num_replicas=context.world_size, rank=context.rank,  # type: ignore[arg-type]
        shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    indices = np.fromiter(sampler, dtype=np.int64)
    return np.array_split(indices, range(batch_size, len(indices), batch_size))


def learning_rate_scheduler(optimizer: torch.optim.Optimizer, options: RunOptions,
                            steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Exponential: the rate times --lr-decay after every epoch. Linear: stepped after every batch, the rate
    rises from lr/W to lr over the first W steps (W: --warmup of all S steps), then falls to lr/(S − W) at
    the last step of --epochs, so the last steps are small and the last weights carry little batch noise."""
    if options.lr_schedule == "exponential":
        assert options.lr_decay is not None  # learning_rate_options sets the schedule's own setting
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=options.lr_decay)
    assert options.warmup is not None
    total = options.epochs * steps_per_epoch
    warmup = round(options.warmup * total)

    def factor(steps_done: int) -> float:
        if steps_done < warmup:
            return (steps_done + 1) / warmup
        return max(total - steps_done, 0) / max(total - warmup, 1)  # (LambdaLR also asks after the last step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def augmentation_generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    """Shifts differ across epochs and ranks, and repeat exactly on --resume."""
    generator = torch.Generator()
    generator.manual_seed(int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0]))
    return generator


def autocast_context(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16)


@dataclass
class EpochResult:
    loss: float
    accuracy: float
    images: int
    seconds: float


@dataclass(frozen=True)
class Run:
    """What every epoch of a run shares: its settings, the model's, and where it runs."""
    options: RunOptions
    config: CapsNetConfig
    context: DistributedContext
    device: torch.device


def train_one_epoch(state: TrainingState, step_model: torch.nn.Module, run: Run, split: Split, epoch: int,
                    progress: EpochProgress, save_progress: Callable[[int, EpochProgress], None]) -> EpochResult:
    """One pass of `step_model` (`state.model` as the steps call it) over this rank's share of `split`, from
    `progress.step` on; the loss and accuracy returned are summed over ranks. Every `options.checkpoint_every` steps,
    `save_progress` gets the progress so far. A linear schedule steps after every batch here; an exponential one is
    the caller's, per epoch."""
    options, config, context, device = run.options, run.config, run.context, run.device
    optimizer, scheduler, scaler = state.optimizer, state.scheduler, state.scaler
    batches = epoch_batches(len(split), options.batch_size // context.world_size, context, options.seed, epoch)
    generator = augmentation_generator(options.seed, epoch, context.rank)
    augmentation = Augmentation(options.max_shift, options.hflip, options.erase)
    augmentation.skip([len(indices) for indices in batches[:progress.step]], generator)
    step_model.train()
    # loss sum, correct, images on this rank; a resumed epoch's totals (already summed over ranks) go to rank 0
    earlier = [progress.loss_sum, progress.correct, progress.images] if context.is_main else [0.0, 0.0, 0.0]
    totals = torch.tensor(earlier, dtype=torch.float64, device=device)  # (3,)
    started = time.perf_counter()
    bar = tqdm(batches[progress.step:], initial=progress.step, total=len(batches),
               desc=f"epoch {epoch + 1}/{options.epochs}", unit="batch", leave=False, dynamic_ncols=True,
               disable=not (options.progress and context.is_main))
    for step, indices in enumerate(bar, start=progress.step + 1):
        images = augmentation(to_float(split.images[indices]), generator).to(device)  # (B, C, H, W)
        labels = torch.as_tensor(split.labels[indices]).to(device)  # (B,)
        with autocast_context(device, options.amp):
            output = step_model(images, labels)
        loss = capsnet_loss(output, images, labels, config, epoch).total
        if not torch.isfinite(loss):
            raise CapsNetError(f"the loss became {loss.item()}; try a lower --lr or drop --amp")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if options.lr_schedule == "linear":
            scheduler.step()
        correct = (output.probabilities.argmax(dim=1) == labels).sum()
        totals += torch.stack([loss.detach().double() * len(indices), correct.double(),
                               totals.new_tensor(len(indices))])
        if not bar.disable:
            bar.set_postfix(loss=f"{totals[0].item() / totals[2].item():.4f}",
                            acc=f"{100 * totals[1].item() / totals[2].item():.1f}%")
        if options.checkpoint_every and step % options.checkpoint_every == 0 and step < len(batches):
            summed = totals.clone()
            distributed.all_reduce_sum(summed, context)
            loss_sum, correct_sum, image_sum = summed.tolist()
            save_progress(epoch, EpochProgress(step, loss_sum, correct_sum, image_sum,
                                               progress.seconds + time.perf_counter() - started))
    distributed.all_reduce_sum(totals, context)
    loss_sum, correct, images = totals.tolist()
    return EpochResult(loss_sum / images, correct / images, int(images),
                       progress.seconds + time.perf_counter() - started)


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
    takes 512 times fewer faults (PyTorch's CPU tuning recipe; docs/experiments: an EM epoch 1.8x faster on an
    AVX2-only AMD EPYC). Freed memory still goes back to the system. c10 reads the variable at its first CPU
    allocation, so this acts only before one, as in `capsnet train`; a value the user set is kept (0 turns it off).
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
            run, config, dataset, resumed, progress = prepare_run(options, context, device)
        if context.is_distributed:  # each rank read its own copy of the data and checkpoint
            with distributed.errors_reported_once(context):
                distributed.check_same_on_every_rank(context, "data or checkpoints",
                                                     run_fingerprint(dataset, resumed, progress))
        return run_epochs(run, config, dataset, resumed, progress, context, device)


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


def prepare_run(options: TrainOptions, context: DistributedContext, device: torch.device,
                ) -> tuple[RunOptions, CapsNetConfig, Dataset, Checkpoint | None, EpochProgress]:
    """Check the user's input against the data and the resumed checkpoint; return the options completed from them,
    the model config, the data, the resumed checkpoint and how far into its next epoch it got."""
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
    run = RunOptions.completed(options, {**drawn, **learning_rate_options(options, config.arch, resumed)})
    progress = EpochProgress()
    if resumed is not None:
        # the model keeps its classes, each by its name: not clothes for digits, nor only some digits
        check_dataset_fits(resumed.config, dataset, f"checkpoint {run.resume}", tuple(resumed.class_names),
                           every_class=True)
        plan = batch_plan(run, context.world_size, len(dataset.train))
        progress = check_resumable(resumed, config, run, plan)
        check_linear_schedule_steps(resumed, run, progress, plan,
                                    epoch_steps(len(dataset.train), run.batch_size, context))
    check_dataset_fits(config, dataset, "the model")
    return run, config, dataset, resumed, progress


def run_fingerprint(dataset: Dataset, resumed: Checkpoint | None, progress: EpochProgress) -> dict[str, object]:
    """What every rank must have alike: the splits (sizes, classes, pixels) and the resumed run (where it stopped, its
    weights: DDP makes the ranks' weights equal once, and ranks with other optimizer states would drift apart)."""
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
            "resumed epoch and step": f"{resumed.epoch if resumed else 0}, {progress.step}",
            "resumed weights' hash": weights.hexdigest()}


def epoch_steps(num_images: int, batch_size: int, context: DistributedContext) -> int:
    """Batches per epoch on each rank (the same on every rank)."""
    return len(epoch_batches(num_images, batch_size // context.world_size, context, 0, 0))


@dataclass
class TrainingState:
    """What a run trains and a checkpoint keeps: the model, its optimizer, learning-rate schedule and loss scaling,
    and a record of every epoch so far."""
    model: Model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    history: list[EpochRecord] = field(default_factory=list)


def new_state(options: RunOptions, config: CapsNetConfig, steps_per_epoch: int, device: torch.device) -> TrainingState:
    """A model initialised from --seed, with a fresh optimizer, schedule and loss scaling."""
    torch.manual_seed(options.seed)
    model = create_model(config).to(device)
    optimizer = torch.optim.Adam(parameter_groups(model, options.lr), lr=options.lr)
    scheduler = learning_rate_scheduler(optimizer, options, steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=options.amp and device.type == "cuda")
    return TrainingState(model, optimizer, scheduler, scaler)


def restore(state: TrainingState, resumed: Checkpoint, options: RunOptions, context: DistributedContext) -> None:
    """Load the resumed run's weights, optimizer, schedule, loss scaling and history into `state`."""
    with distributed.errors_reported_once(context):  # every rank loads the same file: one line, not N
        state.model.load_state_dict(resumed.state_dict)
        # check_resumable refused a checkpoint without them
        assert resumed.optimizer_state is not None and resumed.scheduler_state is not None
        try:  # load_checkpoint checked that these are dicts, not what they hold
            state.optimizer.load_state_dict(resumed.optimizer_state)
            state.scheduler.load_state_dict(resumed.scheduler_state)
            if resumed.scaler_state:  # empty when the run had no CUDA mixed precision
                state.scaler.load_state_dict(resumed.scaler_state)
        except (KeyError, TypeError, ValueError) as err:
            raise CapsNetError(f"checkpoint {options.resume} is damaged: its optimizer state does not load "
                               f"({type(err).__name__}: {err})") from None
    state.history = [EpochRecord.from_dict(record) for record in resumed.history]


def step_model_for(model: Model, options: RunOptions, context: DistributedContext) -> torch.nn.Module:
    """What the training steps call: `model`, in DistributedDataParallel under torchrun, compiled with --compile."""
    if context.is_distributed:
        # A 1-channel Conv1 weight (256, 1, 9, 9) gets its gradient with another (equivalent) stride for the
        # size-1 axis; DDP warns about it on every backward though nothing is wrong.
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    step_model: torch.nn.Module = DistributedDataParallel(model) if context.is_distributed else model
    if options.compile:
        step_model = cast(torch.nn.Module, torch.compile(step_model))  # an OptimizedModule, which is a Module
    return step_model


def run_info(options: RunOptions, dataset: Dataset, model: Model, context: DistributedContext,
             device: torch.device) -> dict[str, Any]:
    """What every checkpoint of the run records about it beside the epoch's figures."""
    return {
        # where the data is, so `capsnet export` calibrates and gates INT8 on the model's own data by default
        "dataset": dataset.name, "data": data_location(options.data),
        "train_images": len(dataset.train), "test_images": len(dataset.test),
        "validation_images": len(dataset.validation or ()), "validation_fraction": dataset.validation_fraction,
        "parameters": count_parameters(model), "batch_size": options.batch_size, "initial_lr": options.lr,
        "lr_schedule": options.lr_schedule, "lr_decay": options.lr_decay, "warmup": options.warmup,
        "epochs": options.epochs, "max_shift": options.max_shift, "hflip": options.hflip, "erase": options.erase,
        "seed": options.seed, "device": device.type, "world_size": context.world_size, "amp": options.amp,
        "compile": options.compile,
    }


def snapshot(state: TrainingState, config: CapsNetConfig, dataset: Dataset, epochs_done: int, metrics: dict,
             plan: dict[str, Any], partial: EpochProgress | None = None) -> Checkpoint:
    """The checkpoint of `state` after `epochs_done` epochs, and `partial`'s steps into the next one."""
    return Checkpoint(
        config=config, state_dict=state.model.state_dict(), class_names=list(dataset.class_names), metrics=metrics,
        epoch=epochs_done, optimizer_state=state.optimizer.state_dict(), scheduler_state=state.scheduler.state_dict(),
        history=[record.to_dict() for record in state.history], dataset=dataset.name,
        scaler_state=state.scaler.state_dict(),
        epoch_progress=None if partial is None else {**asdict(partial), "batch_plan": plan},
    )


def best_epoch(history: list[EpochRecord]) -> EpochRecord | None:
    """The best epoch by validation accuracy (the earliest of equals); without a validation split every epoch is."""
    return max(history, key=lambda record: record.validation.accuracy if record.validation else -1.0, default=None)


def is_new_best(scored: dict[str, Evaluation], best: EpochRecord | None, out: Path) -> bool:
    """Whether an epoch scored so replaces the best one (`out`): selection sees the validation split only, the test
    split is reported."""
    return ("validation" not in scored or best is None or best.validation is None
            or scored["validation"].accuracy > best.validation.accuracy or not out.exists())


def score(model: Model, dataset: Dataset, options: RunOptions, context: DistributedContext,
          device: torch.device) -> dict[str, Evaluation]:
    """The model on the validation split (where there is one) and the test split."""
    per_rank_batch = options.batch_size // context.world_size
    return {name: evaluate(model, split, dataset.class_names, per_rank_batch, device, context,
                           autocast_context(device, options.amp))
            for name, split in (("validation", dataset.validation), ("test", dataset.test)) if split is not None}


def epoch_record(epoch: int, lr: float, trained: EpochResult, scored: dict[str, Evaluation],
                 eval_seconds: float) -> EpochRecord:
    """One epoch's line of the history: its rate, its training figures and its scores."""
    scores = {name: SplitScore(result.loss, result.accuracy) for name, result in scored.items()}
    return EpochRecord(epoch + 1, lr, trained.loss, trained.accuracy, validation=scores.get("validation"),
                       test=scores.get("test"), train_seconds=trained.seconds,
                       train_images_per_second=trained.images / trained.seconds, eval_seconds=eval_seconds)


def run_epochs(options: RunOptions, config: CapsNetConfig, dataset: Dataset, resumed: Checkpoint | None,
               progress: EpochProgress, context: DistributedContext, device: torch.device) -> Checkpoint:
    """Train from the start, or from `resumed` and `progress` into its next epoch, up to `options.epochs`; save the
    last and the best epoch after each one, and return the last epoch's checkpoint."""
    state = new_state(options, config, epoch_steps(len(dataset.train), options.batch_size, context), device)
    if resumed is not None:
        restore(state, resumed, options, context)
    step_model = step_model_for(state.model, options, context)
    run = Run(options, config, context, device)
    info = run_info(options, dataset, state.model, context, device)
    plan = batch_plan(options, context.world_size, len(dataset.train))
    best = best_epoch(state.history)
    processes = f"{context.world_size} process{'es' if context.is_distributed else ''}"
    announce(context, f"training {info['parameters']:,} parameters on {len(dataset.train):,} images of "
                      f"{dataset.name} ({device}, {processes})")
    start_epoch = resumed.epoch if resumed else 0
    if progress.step:
        announce(context, f"resuming epoch {start_epoch + 1} after step {progress.step}")
    checkpoint = resumed

    def save_progress(epoch: int, partial: EpochProgress) -> None:
        if context.is_main:  # weights are the same on every rank
            save_checkpoint(snapshot(state, config, dataset, epoch, {**info, "steps_into_epoch": partial.step}, plan,
                                     partial), options.last_path)

    for epoch in range(start_epoch, options.epochs):
        lr = state.optimizer.param_groups[0]["lr"]
        trained = train_one_epoch(state, step_model, run, dataset.train, epoch, progress, save_progress)
        progress = EpochProgress()
        if options.lr_schedule == "exponential":
            state.scheduler.step()
        started = time.perf_counter()
        scored = score(state.model, dataset, options, context, device)
        record = epoch_record(epoch, lr, trained, scored, time.perf_counter() - started)
        state.history.append(record)
        is_best = is_new_best(scored, best, options.out)
        if is_best:
            best = record
        per_class = {f"{name}_per_class_accuracy": result.per_class_accuracy for name, result in scored.items()}
        checkpoint = snapshot(state, config, dataset, epoch + 1, {**record.to_dict(), **info, **per_class}, plan)
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
    announce_selection(best, options, context)
    return checkpoint


def announce_selection(best: EpochRecord, options: RunOptions, context: DistributedContext) -> None:
    """Which epoch `options.out` holds, and why."""
    assert best.test is not None  # an epoch of this run (is_new_best), which scores the test split
    if best.validation is None:
        announce(context, f"no validation split (--val-fraction 0), so no selection: {options.out} holds the last "
                          f"epoch (test accuracy {100 * best.test.accuracy:.2f}%)")
    else:
        announce(context, f"best validation accuracy {100 * best.validation.accuracy:.2f}% after epoch "
                          f"{best.epoch} (its test accuracy, not used to choose: "
                          f"{100 * best.test.accuracy:.2f}%): {options.out}; last epoch: {options.last_path}")
