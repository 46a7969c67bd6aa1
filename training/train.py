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
from collections.abc import Callable, MutableMapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from capsnet.cpu import MAX_THREADS, CpuKind, bf16_autocast_pays
from capsnet.errors import CapsNetError
from capsnet.training import distributed
from capsnet.training.checkpoint import (Checkpoint, create_model, load_checkpoint, remove_leftover_temporaries,
                                         save_checkpoint)
from capsnet.training.config import PRESETS, CapsNetConfig, preset
from capsnet.training.data import (Augmentation, Dataset, Split, channel_mean_std, data_location, load_dataset,
                                   to_float)
from capsnet.training.distributed import DistributedContext
from capsnet.training.evaluate import check_dataset_fits, evaluate
from capsnet.training.loss import capsnet_loss
from capsnet.training.model import count_parameters


# TrainOptions fields that set the CapsNetConfig field of the same name
MODEL_FLAGS = ("arch", "routing", "routing_iterations", "squash_constant", "reconstruction_weight",
               "detach_agreement")
DYNAMIC_ROUTING_FLAGS = ("routing", "squash_constant", "detach_agreement")
# Routing flags an architecture has no such setting for, with why: refused, not silently ignored.
REFUSED_ROUTING_FLAGS = {
    "em": (DYNAMIC_ROUTING_FLAGS, "sets dynamic routing; EM routing (--arch em) has no such setting"),
    "gap-cnn": ((*DYNAMIC_ROUTING_FLAGS, "routing_iterations"),
                "sets capsule routing; a gap-cnn model has no capsules"),
}
# The preset of a new run without --preset, and the architectures of the presets each --arch takes (the CNN
# baseline takes its input size from a fixed-size capsule preset, the any-size models have presets of their own).
DEFAULT_PRESET = {"capsnet": "paper", "em": "em", "cnn-baseline": "paper", "shared-capsnet": "shared",
                  "gap-cnn": "gap-cnn"}
PRESET_ARCHITECTURES = {"capsnet": ("capsnet",), "em": ("em",), "cnn-baseline": ("capsnet", "em"),
                        "shared-capsnet": ("shared-capsnet",), "gap-cnn": ("gap-cnn",)}
# EM routing's activations move through a small inverse temperature λ, so it learns at 10× the rate
# (0.01, as public EM implementations train; at 0.001 a small EM model barely learns in an epoch).
DEFAULT_LR = {"capsnet": 1e-3, "em": 1e-2, "cnn-baseline": 1e-3, "shared-capsnet": 1e-3, "gap-cnn": 1e-3}
LR_SCHEDULES = ("exponential", "linear")
# EM's 3-epoch runs on the embedded digits averaged 96.1% with the rate falling to 0 per step against 94.3% with the
# best per-epoch decay tried (five seeds each, docs/experiments); the other models keep the schedule their figures
# were measured with.
DEFAULT_LR_SCHEDULE = {"capsnet": "exponential", "em": "linear", "cnn-baseline": "exponential",
                       "shared-capsnet": "exponential", "gap-cnn": "exponential"}
DEFAULT_LR_DECAY = 0.9
DEFAULT_WARMUP = 0.1
SEED_LIMIT = 2**63  # torch.manual_seed and numpy's SeedSequence both take 0 .. 2**63 - 1
DEFAULT_VAL_FRACTION = 0.1


@dataclass
class TrainOptions:
    data: str = "embedded"
    out: Path = Path("model.ckpt")
    # model: None keeps the preset's value (or, with --resume, the checkpoint's)
    preset: str | None = None  # `paper` for a new run
    arch: str | None = None  # `capsnet` for a new run
    routing: str | None = None
    routing_iterations: int | None = None
    squash_constant: float | None = None
    reconstruction_weight: float | None = None
    detach_agreement: bool | None = None
    normalize: bool = False  # standardise inputs with the training split's per-channel mean/std
    # share of the training images held out to choose the best epoch; 0: none; None: the resumed
    # checkpoint's (0 for one from before the split), else DEFAULT_VAL_FRACTION
    val_fraction: float | None = None
    # optimisation
    epochs: int = 10
    batch_size: int = 64
    lr: float | None = None  # Adam's rate; None: DEFAULT_LR of the architecture (with --resume: the checkpoint's)
    lr_schedule: str | None = None  # None: DEFAULT_LR_SCHEDULE of the architecture (with --resume: the checkpoint's)
    lr_decay: float | None = None  # exponential: multiplies the learning rate after every epoch (DEFAULT_LR_DECAY)
    warmup: float | None = None  # linear: share of the steps the rate rises over (DEFAULT_WARMUP)
    # the batches and their draws; None: with --resume the checkpoint's, else RUN_DEFAULTS
    max_shift: int | None = None
    hflip: bool | None = None  # random left-right mirror (clothes, not digits)
    erase: float | None = None  # probability of random erasing per image
    seed: int | None = None
    # execution
    device: str = "auto"
    amp: bool = False  # fp16 autocast + gradient scaling on CUDA, bf16 autocast on a CPU with native bf16
    compile: bool = False
    threads: int | None = None
    resume: Path | None = None
    checkpoint_every: int | None = None  # also write the last checkpoint every N steps inside an epoch
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

    @property
    def last_path(self) -> Path:
        return last_checkpoint_path(self.out)


def last_checkpoint_path(out: Path) -> Path:
    """The last epoch's checkpoint, next to the best one: model.ckpt -> model.last.ckpt."""
    return out.with_name(f"{out.stem}.last.ckpt")


# The settings that fix an epoch's batches and shifts; a run resumed mid-epoch must keep them.
BATCH_PLAN_FLAGS = {"batch_size": "--batch-size", "seed": "--seed", "max_shift": "--max-shift", "hflip": "--hflip",
                    "erase": "--erase", "world_size": "processes", "train_images": "training images"}
# Of those, the ones a run keeps from start to end (a resume at an epoch's end may change the batch size, the
# processes or the folder), with their defaults for a new run.
RUN_DEFAULTS = {"seed": 0, "max_shift": 2, "hflip": False, "erase": 0.0}
# what checkpoints from before a flag existed trained with
BATCH_PLAN_BEFORE_FLAG = {"hflip": False, "erase": 0.0}


@dataclass
class EpochProgress:
    """How far into an epoch a run got, with its running totals over all ranks (for a mid-epoch --resume)."""
    step: int = 0  # batches done
    loss_sum: float = 0.0
    correct: float = 0.0
    images: float = 0.0
    seconds: float = 0.0


def model_config(options: TrainOptions, dataset: Dataset, base: CapsNetConfig | None) -> CapsNetConfig:
    """The preset sized for the data, with the model flags applied; `base` (a resumed model) replaces the preset."""
    channels, height, width = dataset.image_shape
    if options.preset is not None or base is None:
        base = preset(options.preset or DEFAULT_PRESET[options.arch or "capsnet"], in_channels=channels,
                      height=height, width=width, num_classes=len(dataset.class_names))
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
    sampler = DistributedSampler(range(num_images), num_replicas=context.world_size, rank=context.rank,
                                 shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    indices = np.fromiter(sampler, dtype=np.int64)
    return np.array_split(indices, range(batch_size, len(indices), batch_size))


def run_options(options: TrainOptions, resumed: Checkpoint | None) -> TrainOptions:
    """`options` with --seed, --max-shift, --hflip and --erase filled in: given, the resumed run's, or RUN_DEFAULTS.
    A resumed run keeps them: its batches and draws derive from them and the epoch, and its checkpoints say that
    the whole run used them."""
    recorded = {**BATCH_PLAN_BEFORE_FLAG, **resumed.metrics} if resumed is not None else {}
    values = {name: recorded.get(name, default) if getattr(options, name) is None else getattr(options, name)
              for name, default in RUN_DEFAULTS.items()}
    changes = [f"{BATCH_PLAN_FLAGS[name]} {value} (checkpoint: {recorded[name]})"
               for name, value in values.items() if name in recorded and recorded[name] != value]
    if changes and resumed.epoch_progress is None:  # mid-epoch, check_resumable names every batch setting changed
        raise CapsNetError(f"--resume continues the checkpoint's shuffling and augmentation: {', '.join(changes)}")
    return replace(options, **values)


def learning_rate_options(options: TrainOptions, arch: str, resumed: Checkpoint | None) -> TrainOptions:
    """`options` with the learning rate, the schedule and its setting filled in: given, the resumed run's, or the
    architecture's default. A resumed run keeps its rate and schedule; a linear one also its length, since the rate
    reaches 0 at its last step."""
    recorded = resumed.metrics if resumed is not None else {}
    # the rate travels in the optimizer state, which a resume loads over any other
    lr = options.lr if options.lr is not None else recorded.get("initial_lr", DEFAULT_LR[arch])
    if resumed is not None and recorded.get("initial_lr", lr) != lr:
        raise CapsNetError(f"--resume continues the checkpoint's learning rate: --lr {lr} "
                           f"(checkpoint: {recorded['initial_lr']})")
    # checkpoints from before --lr-schedule decayed exponentially
    recorded_schedule = recorded.get("lr_schedule", "exponential") if resumed is not None else None
    schedule = options.lr_schedule or recorded_schedule or DEFAULT_LR_SCHEDULE[arch]
    if recorded_schedule not in (None, schedule):
        raise CapsNetError(f"--resume continues the checkpoint's learning-rate schedule: --lr-schedule {schedule} "
                           f"(checkpoint: {recorded_schedule})")
    if schedule == "exponential":
        if options.warmup is not None:
            raise CapsNetError("--warmup belongs to --lr-schedule linear; the exponential schedule has none")
        setting, value, default = "lr_decay", options.lr_decay, DEFAULT_LR_DECAY
    else:
        if options.lr_decay is not None:
            raise CapsNetError("--lr-decay belongs to --lr-schedule exponential; the linear schedule falls to 0 "
                               "at the last step of --epochs")
        setting, value, default = "warmup", options.warmup, DEFAULT_WARMUP
        planned = recorded.get("epochs", options.epochs)
        if resumed is not None and planned != options.epochs:
            if resumed.epoch >= planned:
                raise CapsNetError(f"{options.resume} has finished its linear learning-rate schedule (the rate "
                                   f"fell to 0 in epoch {planned}); a longer run is a new one with a larger --epochs")
            raise CapsNetError(f"{options.resume} follows a linear learning-rate schedule that ends after epoch "
                               f"{planned}; resume it with --epochs {planned}")
    if value is None:
        value = recorded.get(setting, default)
    elif resumed is not None and recorded.get(setting, value) != value:
        raise CapsNetError(f"--resume continues the checkpoint's learning-rate schedule: "
                           f"--{setting.replace('_', '-')} {value} (checkpoint: {recorded[setting]})")
    return replace(options, lr=lr, lr_schedule=schedule, **{setting: value})


def learning_rate_scheduler(optimizer: torch.optim.Optimizer, options: TrainOptions,
                            steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Exponential: the rate times --lr-decay after every epoch. Linear: stepped after every batch, the rate
    rises from lr/W to lr over the first W steps (W: --warmup of all S steps), then falls to lr/(S − W) at
    the last step of --epochs, so the last steps are small and the last weights carry little batch noise."""
    if options.lr_schedule == "exponential":
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=options.lr_decay)
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


def train_one_epoch(step_model: torch.nn.Module, config: CapsNetConfig, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler, split: Split,
                    epoch: int, options: TrainOptions, context: DistributedContext, device: torch.device,
                    progress: EpochProgress, save_progress: Callable[[int, EpochProgress], None]) -> EpochResult:
    """One pass over this rank's share of `split`, from `progress.step` on; the loss and accuracy returned are
    summed over ranks. Every `options.checkpoint_every` steps, `save_progress` gets the progress so far.
    A linear `scheduler` steps after every batch here; an exponential one is the caller's, per epoch."""
    batches = epoch_batches(len(split), options.batch_size // context.world_size, context, options.seed, epoch)
    generator = augmentation_generator(options.seed, epoch, context.rank)
    augmentation = Augmentation(options.max_shift, options.hflip, options.erase)
    augmentation.skip([len(indices) for indices in batches[:progress.step]], generator)
    step_model.train()
    # loss sum, correct, images on this rank; a resumed epoch's totals (already summed over ranks) go to rank 0
    earlier = [progress.loss_sum, progress.correct, progress.images] if context.is_main else [0.0, 0.0, 0.0]
    totals = torch.tensor(earlier, dtype=torch.float64, device=device)  # (3,)
    started = time.perf_counter()
    bar = tqdm(batches[progress.step:], initial=progress.step, total=len(batches), desc=f"epoch {epoch + 1}/{options.epochs}",
               unit="batch", leave=False, dynamic_ncols=True, disable=not (options.progress and context.is_main))
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
            save_progress(epoch, EpochProgress(step, *summed.tolist(), progress.seconds + time.perf_counter() - started))
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
    if device.type == "cpu" and (options.threads or context.local_world_size > 1):
        # The processes on one machine share its cores.
        torch.set_num_threads(options.threads or max(1, (os.cpu_count() or 1) // context.local_world_size))
    with distributed.process_group(context, device):
        # the ranks check together: a mistake on any of them stops every one, with one line from rank 0
        with distributed.errors_reported_once(context):
            options, config, dataset, resumed, progress = prepare_run(options, context, device)
        if context.is_distributed:  # each rank read its own copy of the data and checkpoint
            with distributed.errors_reported_once(context):
                distributed.check_same_on_every_rank(context, "data or checkpoints",
                                                     run_fingerprint(dataset, resumed, progress))
        return run_epochs(options, config, dataset, resumed, progress, context, device)


def prepare_run(options: TrainOptions, context: DistributedContext, device: torch.device,
                ) -> tuple[TrainOptions, CapsNetConfig, Dataset, Checkpoint | None, EpochProgress]:
    """Check the user's input against the data and the resumed checkpoint; return the options completed from them,
    the model config, the data, the resumed checkpoint and how far into its next epoch it got."""
    if options.batch_size % context.world_size:
        raise CapsNetError(f"--batch-size {options.batch_size} is not divisible by the {context.world_size} processes")
    if options.amp and device.type == "cpu":
        native, why = bf16_autocast_pays(CpuKind.this_host(), torch.backends.cpu.get_cpu_capability())
        if not native:
            announce(context, f"--amp: training in fp32: {why}; emulated bf16 is many times slower than fp32")
            options = replace(options, amp=False)
    prepare_output(options.out, context)
    resumed = load_checkpoint(options.resume) if options.resume is not None else None
    options = run_options(options, resumed)
    if options.val_fraction is None:
        # checkpoints from before the validation split trained on every training image
        options.val_fraction = resumed.metrics.get("validation_fraction", 0.0) if resumed else DEFAULT_VAL_FRACTION
    dataset = load_dataset(options.data, options.val_fraction)
    if options.max_shift >= min(dataset.image_shape[1:]):
        raise CapsNetError(f"--max-shift {options.max_shift} is not smaller than the {dataset.image_shape[1]}x"
                           f"{dataset.image_shape[2]} images")
    config = model_config(options, dataset, resumed.config if resumed else None)
    options = learning_rate_options(options, config.arch, resumed)
    progress = EpochProgress()
    if resumed is not None:
        # the model keeps its classes, each by its name: not clothes for digits, nor only some digits
        check_dataset_fits(resumed.config, dataset, f"checkpoint {options.resume}", tuple(resumed.class_names),
                           every_class=True)
        progress = check_resumable(resumed, config, options, batch_plan(options, context, dataset))
        check_linear_schedule_steps(resumed, options, progress, context, dataset)
    check_dataset_fits(config, dataset, "the model")
    return options, config, dataset, resumed, progress


def run_fingerprint(dataset: Dataset, resumed: Checkpoint | None, progress: EpochProgress) -> dict[str, object]:
    """What every rank must have alike: the splits (sizes, classes, pixels) and the resumed run (where it stopped, its
    weights: DDP makes the ranks' weights equal once, and ranks with other optimizer states would drift apart)."""
    splits = (dataset.train, dataset.validation, dataset.test)
    pixels, weights = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
    for split in splits:
        if split is not None:
            pixels.update(np.ascontiguousarray(split.images))
            pixels.update(np.ascontiguousarray(split.labels))
    for name, tensor in sorted(resumed.state_dict.items() if resumed else ()):
        weights.update(name.encode())
        weights.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return {"training/validation/test images": "/".join(str(len(split or ())) for split in splits),
            "classes": ", ".join(dataset.class_names), "image shape": "x".join(map(str, dataset.image_shape)),
            "images' content hash": pixels.hexdigest(),
            "resumed epoch and step": f"{resumed.epoch if resumed else 0}, {progress.step}",
            "resumed weights' hash": weights.hexdigest()}


def batch_plan(options: TrainOptions, context: DistributedContext, dataset: Dataset) -> dict[str, int]:
    """The values of BATCH_PLAN_FLAGS for this run."""
    return {"batch_size": options.batch_size, "seed": options.seed, "max_shift": options.max_shift,
            "hflip": options.hflip, "erase": options.erase, "world_size": context.world_size,
            "train_images": len(dataset.train)}


def check_resumable(resumed: Checkpoint, config: CapsNetConfig, options: TrainOptions,
                    plan: dict[str, int]) -> EpochProgress:
    """Resuming continues the same model; flags given again must agree with the checkpoint.
    Returns how far into its next epoch the checkpoint got (nothing at an epoch's end)."""
    recorded = resumed.config.to_dict()
    changed = {name: value for name, value in config.to_dict().items() if recorded[name] != value}
    if changed:
        listed = ", ".join(f"{name}={value!r} (checkpoint: {recorded[name]!r})" for name, value in changed.items())
        raise CapsNetError(f"--resume continues the checkpoint's model; these flags change it: {listed}")
    if resumed.optimizer_state is None or resumed.scheduler_state is None:
        raise CapsNetError(f"{options.resume} holds no optimizer state to resume from")
    recorded_fraction = resumed.metrics.get("validation_fraction", 0.0)
    if recorded_fraction != options.val_fraction:
        raise CapsNetError(f"--resume continues the checkpoint's training images: --val-fraction "
                           f"{options.val_fraction} (checkpoint: {recorded_fraction})")
    if resumed.epoch >= options.epochs:
        raise CapsNetError(f"{options.resume} has already trained {resumed.epoch} epochs; pass --epochs above that")
    if resumed.epoch_progress is None:
        return EpochProgress()
    try:
        fields = dict(resumed.epoch_progress)
        recorded_plan = {**BATCH_PLAN_BEFORE_FLAG, **fields.pop("batch_plan")}
        planned = {name: recorded_plan[name] for name in plan}
        progress = EpochProgress(**fields)
    except (KeyError, TypeError):
        raise CapsNetError(f"checkpoint {options.resume} is damaged: its progress into epoch {resumed.epoch + 1} "
                           "is incomplete") from None
    plan_changes = [f"{BATCH_PLAN_FLAGS[name]} {value} (checkpoint: {planned[name]})"
                    for name, value in plan.items() if planned[name] != value]
    if plan_changes:
        raise CapsNetError(f"{options.resume} stopped {progress.step} steps into epoch {resumed.epoch + 1}; "
                           f"continuing that epoch needs its batches: {', '.join(plan_changes)}")
    return progress


def check_linear_schedule_steps(resumed: Checkpoint, options: TrainOptions, progress: EpochProgress,
                                context: DistributedContext, dataset: Dataset) -> None:
    """A linear schedule is laid out in steps (--epochs times the steps of an epoch), and the resumed scheduler
    continues at its step count. Another number of steps an epoch (--batch-size, the training set, the processes)
    would put that count on a schedule of another length: the rate would jump, or sit at 0 for the epochs left."""
    done = (resumed.scheduler_state or {}).get("last_epoch")
    if options.lr_schedule != "linear" or not isinstance(done, int) or not resumed.epoch:
        return  # nothing to compare (a damaged state is reported when it is loaded)
    steps = epoch_steps(len(dataset.train), options.batch_size, context)
    if done == resumed.epoch * steps + progress.step:
        return
    recorded = resumed.metrics
    changes = [f"{BATCH_PLAN_FLAGS[name]} {value} (checkpoint: {recorded[name]})"
               for name, value in (("batch_size", options.batch_size), ("train_images", len(dataset.train)),
                                   ("world_size", context.world_size)) if recorded.get(name, value) != value]
    raise CapsNetError(f"{options.resume} follows a linear learning-rate schedule of "
                       f"{(done - progress.step) // resumed.epoch} steps an epoch; this run takes {steps}"
                       f"{': ' + ', '.join(changes) if changes else ''}")


def epoch_steps(num_images: int, batch_size: int, context: DistributedContext) -> int:
    """Batches per epoch on each rank (the same on every rank)."""
    return len(epoch_batches(num_images, batch_size // context.world_size, context, 0, 0))


def run_epochs(options: TrainOptions, config: CapsNetConfig, dataset: Dataset, resumed: Checkpoint | None,
               progress: EpochProgress, context: DistributedContext, device: torch.device) -> Checkpoint:
    """Train from the start, or from `resumed` and `progress` into its next epoch, up to `options.epochs`."""
    torch.manual_seed(options.seed)
    model = create_model(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
    per_rank_batch = options.batch_size // context.world_size
    scheduler = learning_rate_scheduler(optimizer, options, epoch_steps(len(dataset.train), options.batch_size, context))
    scaler = torch.amp.GradScaler(device.type, enabled=options.amp and device.type == "cuda")
    history: list[dict] = []
    if resumed is not None:
        with distributed.errors_reported_once(context):  # every rank loads the same file: one line, not N
            model.load_state_dict(resumed.state_dict)
            try:  # load_checkpoint checked that these are dicts, not what they hold
                optimizer.load_state_dict(resumed.optimizer_state)
                scheduler.load_state_dict(resumed.scheduler_state)
                if resumed.scaler_state:  # empty when the run had no CUDA mixed precision
                    scaler.load_state_dict(resumed.scaler_state)
            except (KeyError, TypeError, ValueError) as err:
                raise CapsNetError(f"checkpoint {options.resume} is damaged: its optimizer state does not load "
                                   f"({type(err).__name__}: {err})") from None
        history = list(resumed.history)
    if context.is_distributed:
        # A 1-channel Conv1 weight (256, 1, 9, 9) gets its gradient with another (equivalent) stride for the
        # size-1 axis; DDP warns about it on every backward though nothing is wrong.
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    step_model = DistributedDataParallel(model) if context.is_distributed else model
    if options.compile:
        step_model = torch.compile(step_model)
    run_info = {
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
    plan = batch_plan(options, context, dataset)

    def snapshot(epochs_done: int, metrics: dict, partial: EpochProgress | None = None) -> Checkpoint:
        return Checkpoint(
            config=config, state_dict=model.state_dict(), class_names=list(dataset.class_names), metrics=metrics,
            epoch=epochs_done, optimizer_state=optimizer.state_dict(), scheduler_state=scheduler.state_dict(),
            history=list(history), dataset=dataset.name, scaler_state=scaler.state_dict(),
            epoch_progress=None if partial is None else {**asdict(partial), "batch_plan": plan},
        )

    # The best epoch by validation accuracy (the earliest of equals); without a validation split every epoch is.
    best = max(history, key=lambda record: record.get("validation_accuracy", -1.0), default=None)
    processes = f"{context.world_size} process{'es' if context.is_distributed else ''}"
    announce(context, f"training {run_info['parameters']:,} parameters on {len(dataset.train):,} images of "
                      f"{dataset.name} ({device}, {processes})")
    start_epoch = resumed.epoch if resumed else 0
    if progress.step:
        announce(context, f"resuming epoch {start_epoch + 1} after step {progress.step}")
    checkpoint = resumed

    def save_progress(epoch: int, partial: EpochProgress) -> None:
        if context.is_main:  # weights are the same on every rank
            save_checkpoint(snapshot(epoch, {**run_info, "steps_into_epoch": partial.step}, partial), options.last_path)

    for epoch in range(start_epoch, options.epochs):
        lr = optimizer.param_groups[0]["lr"]
        trained = train_one_epoch(step_model, config, optimizer, scheduler, scaler, dataset.train, epoch, options,
                                  context, device, progress, save_progress)
        progress = EpochProgress()
        if options.lr_schedule == "exponential":
            scheduler.step()
        started = time.perf_counter()
        scored = {name: evaluate(model, split, dataset.class_names, per_rank_batch, device, context,
                                 autocast_context(device, options.amp))
                  for name, split in (("validation", dataset.validation), ("test", dataset.test)) if split is not None}
        record = {"epoch": epoch + 1, "lr": lr, "train_loss": trained.loss, "train_accuracy": trained.accuracy}
        for name, result in scored.items():
            record.update({f"{name}_loss": result.loss, f"{name}_accuracy": result.accuracy})
        record.update({"train_seconds": trained.seconds, "train_images_per_second": trained.images / trained.seconds,
                       "eval_seconds": time.perf_counter() - started})
        history.append(record)
        # selection sees the validation split only; the test split is reported
        is_best = ("validation" not in scored or best is None
                   or scored["validation"].accuracy > best["validation_accuracy"] or not options.out.exists())
        if is_best:
            best = record
        per_class = {f"{name}_per_class_accuracy": result.per_class_accuracy for name, result in scored.items()}
        checkpoint = snapshot(epoch + 1, {**record, **run_info, **per_class})
        if context.is_main:
            save_checkpoint(checkpoint, options.last_path)
            if is_best:
                save_checkpoint(checkpoint, options.out)
        figures = " | ".join(f"{name} loss {result.loss:.4f} acc {100 * result.accuracy:.2f}%"
                             for name, result in scored.items())
        announce(context, f"epoch {epoch + 1}/{options.epochs}: "
                          f"train loss {trained.loss:.4f} acc {100 * trained.accuracy:.2f}% | {figures} | "
                          f"{record['train_images_per_second']:.0f} images/s, {trained.seconds:.1f}s"
                          + (f" | best -> {options.out}" if is_best and "validation" in scored else ""))
    if dataset.validation is None:
        announce(context, f"no validation split (--val-fraction 0), so no selection: {options.out} holds the last "
                          f"epoch (test accuracy {100 * best['test_accuracy']:.2f}%)")
    else:
        announce(context, f"best validation accuracy {100 * best['validation_accuracy']:.2f}% after epoch "
                          f"{best['epoch']} (its test accuracy, not used to choose: {100 * best['test_accuracy']:.2f}%): "
                          f"{options.out}; last epoch: {options.last_path}")
    return checkpoint
