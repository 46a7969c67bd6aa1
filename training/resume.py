"""What `capsnet train --resume` keeps of its checkpoint, and the checks that hold a resumed run to it.

SETTINGS is the one table of the training settings: each one's flag, its default for a new run, and what a resume
does with it. A resume continues one run, so the settings its weights, batches and learning rates derive from stay
the checkpoint's: left out, they are taken from it; given, they must agree. The steps of an epoch (the batch size,
the processes, the training images) may change at an epoch's end, not inside one. The rest (where the data and
the checkpoints are, the device, the threads) belong to each invocation.

The module imports neither torch nor numpy: `capsnet train --help` derives its help text from the table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from capsnet.errors import CapsNetError

if TYPE_CHECKING:
    from capsnet.models.checkpoint import Checkpoint
    from capsnet.models.config import CapsNetConfig
    from capsnet.training.options import RunOptions, TrainOptions


class Resume(enum.Enum):
    KEEPS = "keeps"  # left out, the checkpoint's; given, it must agree
    EPOCH_END = "may change at an epoch's end"  # it shapes an epoch's batches: a resume mid-epoch keeps it
    NEVER = "never keeps"  # each invocation's own


@dataclass(frozen=True)
class ByArch:
    """A default that depends on --arch: `base`, or the value `others` names for the architecture."""
    base: Any
    others: dict[str, Any] = field(default_factory=dict)

    def of(self, arch: str | None) -> Any:
        return self.base if arch is None else self.others.get(arch, self.base)

    def __str__(self) -> str:
        return "; ".join([str(self.base), *(f"{value} for --arch {arch}" for arch, value in self.others.items())])


# What a checkpoint's value decides, named by the message that refuses a resume changing it.
MODEL = "model"
TRAINING_IMAGES = "training images"
LEARNING_RATE = "learning rate"
SCHEDULE = "learning-rate schedule"
AUGMENTATION = "shuffling and augmentation"


@dataclass(frozen=True)
class Setting:
    flag: str  # the command-line flag; for a setting no flag sets, what it is ("processes")
    default: Any  # for a new run (a ByArch where the architectures differ); None: none of its own (see `flag`'s help)
    resume: Resume
    what: str = ""  # what the checkpoint's value decides (KEEPS)
    metric: str | None = None  # its key in the checkpoint's metrics; None: not there (the model config holds it)
    batches: bool = False  # an epoch's batches and random draws derive from it
    config_field: bool = False  # it sets the CapsNetConfig field of the same name

    def change(self, value: Any, recorded: Any) -> str:
        return f"{self.flag} {value} (checkpoint: {recorded})"


SETTINGS: dict[str, Setting] = {
    "data": Setting("--data", "embedded", Resume.NEVER),  # moved or copied data of the same classes continues
    "out": Setting("--out", "model.ckpt", Resume.NEVER),
    "val_fraction": Setting("--val-fraction", 0.1, Resume.KEEPS, TRAINING_IMAGES, "validation_fraction"),
    # the model: checked against the checkpoint's config
    "preset": Setting("--preset", ByArch("paper", {"em": "em", "shared-capsnet": "shared", "gap-cnn": "gap-cnn"}),
                      Resume.KEEPS, MODEL),
    "arch": Setting("--arch", None, Resume.KEEPS, MODEL, config_field=True),
    "routing": Setting("--routing", None, Resume.KEEPS, MODEL, config_field=True),
    "routing_iterations": Setting("--routing-iterations", None, Resume.KEEPS, MODEL, config_field=True),
    "squash_constant": Setting("--squash-constant", None, Resume.KEEPS, MODEL, config_field=True),
    "reconstruction_weight": Setting("--reconstruction-weight", None, Resume.KEEPS, MODEL, config_field=True),
    "detach_agreement": Setting("--detach-agreement", None, Resume.KEEPS, MODEL, config_field=True),
    "normalize": Setting("--normalize", False, Resume.KEEPS, MODEL),
    # optimisation; a linear schedule also keeps --epochs (learning_rate_options)
    "epochs": Setting("--epochs", 10, Resume.NEVER, metric="epochs"),
    "batch_size": Setting("--batch-size", 64, Resume.EPOCH_END, metric="batch_size", batches=True),
    # The rate travels in the optimizer state, which a resume loads over any other. EM routing's activations move
    # through a small inverse temperature λ, so it learns at 10× the rate (0.01, as public EM implementations train;
    # at 0.001 a small EM model barely learns in an epoch).
    "lr": Setting("--lr", ByArch(1e-3, {"em": 1e-2}), Resume.KEEPS, LEARNING_RATE, "initial_lr"),
    # EM's rate falls to 0 per step: over five seeds it beat the best per-epoch decay tried (docs/experiments/README.md,
    # "A learning rate that falls to zero"); the other models keep the schedule their figures were measured with.
    "lr_schedule": Setting("--lr-schedule", ByArch("exponential", {"em": "linear"}), Resume.KEEPS, SCHEDULE,
                           "lr_schedule"),
    "lr_decay": Setting("--lr-decay", 0.9, Resume.KEEPS, SCHEDULE, "lr_decay"),  # exponential only
    "warmup": Setting("--warmup", 0.1, Resume.KEEPS, SCHEDULE, "warmup"),  # linear only
    # the batches and their random draws (with the batch size, the processes and the training images)
    "seed": Setting("--seed", 0, Resume.KEEPS, AUGMENTATION, "seed", batches=True),
    "max_shift": Setting("--max-shift", 2, Resume.KEEPS, AUGMENTATION, "max_shift", batches=True),
    "hflip": Setting("--hflip", False, Resume.KEEPS, AUGMENTATION, "hflip", batches=True),
    "erase": Setting("--erase", 0.0, Resume.KEEPS, AUGMENTATION, "erase", batches=True),
    "train_images": Setting("training images", None, Resume.EPOCH_END, metric="train_images", batches=True),
    "world_size": Setting("processes", None, Resume.EPOCH_END, metric="world_size", batches=True),
    # execution
    "device": Setting("--device", "auto", Resume.NEVER),
    "amp": Setting("--amp", False, Resume.NEVER),
    "compile": Setting("--compile", False, Resume.NEVER),
    "threads": Setting("--threads", None, Resume.NEVER),  # torch's
    "checkpoint_every": Setting("--checkpoint-every", None, Resume.NEVER),  # at each epoch's end only
}
LR_SCHEDULES = ("exponential", "linear")
MODEL_FLAGS = tuple(name for name, setting in SETTINGS.items() if setting.config_field)
# what fixes an epoch's batches: a checkpoint written mid-epoch records them as its batch plan
BATCH_PLAN = tuple(name for name, setting in SETTINGS.items() if setting.batches)
# what a checkpoint's metrics must hold to be resumed
RECORDED = tuple(setting.metric for setting in SETTINGS.values() if setting.metric)


def default(name: str) -> Any:
    return SETTINGS[name].default


def default_help(name: str) -> str:
    """The default as `capsnet train --help` states it: `default 0.001; 0.01 for --arch em; with --resume the
    checkpoint's`."""
    setting = SETTINGS[name]
    value = ("on" if setting.default else "off") if isinstance(setting.default, bool) else setting.default
    kept = "with --resume the checkpoint's" if setting.resume is Resume.KEEPS else ""
    return "; ".join(part for part in (f"default {value}", kept) if part)


@dataclass
class EpochProgress:
    """How far into an epoch a run got, with its running totals over all ranks (for a mid-epoch --resume)."""
    step: int = 0  # batches done
    loss_sum: float = 0.0
    correct: float = 0.0
    images: float = 0.0
    seconds: float = 0.0


def _completed(options: TrainOptions, names: tuple[str, ...], resumed: Checkpoint | None,
               arch: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Each of `names` as the run takes it (given, the resumed run's, or the default), and how the given values
    differ from the checkpoint's."""
    recorded = resumed.metrics if resumed is not None else {}
    values, changes = {}, []
    for name in names:
        setting = SETTINGS[name]
        fallback = setting.default.of(arch) if isinstance(setting.default, ByArch) else setting.default
        given = getattr(options, name)
        kept = recorded.get(setting.metric, fallback) if setting.metric else fallback
        values[name] = given if given is not None else kept
        if setting.metric in recorded and recorded[setting.metric] != values[name]:
            changes.append(setting.change(values[name], recorded[setting.metric]))
    return values, changes


def _refused(what: str, changes: list[str]) -> CapsNetError:
    return CapsNetError(f"--resume continues the checkpoint's {what}: {', '.join(changes)}")


def run_options(options: TrainOptions, resumed: Checkpoint | None) -> dict[str, Any]:
    """The validation share, --seed, --max-shift, --hflip and --erase as the run takes them: given, the resumed
    run's, or the defaults. A resumed run keeps them: its training images, batches and draws derive from them and
    the epoch, and its checkpoints say that the whole run used them."""
    fraction, changes = _completed(options, ("val_fraction",), resumed)
    if changes:
        raise _refused(TRAINING_IMAGES, changes)
    drawn = tuple(name for name in BATCH_PLAN if SETTINGS[name].resume is Resume.KEEPS)
    values, changes = _completed(options, drawn, resumed)
    # mid-epoch, check_resumable names every batch setting changed
    if changes and resumed is not None and resumed.epoch_progress is None:
        raise _refused(AUGMENTATION, changes)
    return {**fraction, **values}


def learning_rate_options(options: TrainOptions, arch: str, resumed: Checkpoint | None) -> dict[str, Any]:
    """The learning rate, the schedule and its setting as the run takes them: given, the resumed run's, or the
    architecture's default. A resumed run keeps its rate and schedule; a linear one also its length, since the rate
    reaches 0 at its last step."""
    values = {}
    for name, what in (("lr", LEARNING_RATE), ("lr_schedule", SCHEDULE)):
        value, changes = _completed(options, (name,), resumed, arch)
        if changes:
            raise _refused(what, changes)
        values.update(value)
    if values["lr_schedule"] == "exponential":
        if options.warmup is not None:
            raise CapsNetError("--warmup belongs to --lr-schedule linear; the exponential schedule has none")
        setting = "lr_decay"
    else:
        if options.lr_decay is not None:
            raise CapsNetError("--lr-decay belongs to --lr-schedule exponential; the linear schedule falls to 0 "
                               "at the last step of --epochs")
        setting = "warmup"
        if resumed is not None and (planned := resumed.metrics.get("epochs", options.epochs)) != options.epochs:
            if resumed.epoch >= planned:
                raise CapsNetError(f"{options.resume} has finished its linear learning-rate schedule (the rate "
                                   f"fell to 0 in epoch {planned}); a longer run is a new one with a larger --epochs")
            raise CapsNetError(f"{options.resume} follows a linear learning-rate schedule that ends after epoch "
                               f"{planned}; resume it with --epochs {planned}")
    value, changes = _completed(options, (setting,), resumed, arch)
    if changes:
        raise _refused(SCHEDULE, changes)
    return {**values, **value}


def batch_plan(options: RunOptions, world_size: int, train_images: int) -> dict[str, Any]:
    """The values of BATCH_PLAN for this run."""
    counts = {"world_size": world_size, "train_images": train_images}
    return {name: counts[name] if name in counts else getattr(options, name) for name in BATCH_PLAN}


def check_resumable(resumed: Checkpoint, config: CapsNetConfig, options: RunOptions,
                    plan: dict[str, Any]) -> EpochProgress:
    """Resuming continues the same model; flags given again must agree with the checkpoint.
    Returns how far into its next epoch the checkpoint got (nothing at an epoch's end)."""
    recorded = resumed.config.to_dict()
    changed = {name: value for name, value in config.to_dict().items() if recorded[name] != value}
    if changed:
        listed = ", ".join(f"{name}={value!r} (checkpoint: {recorded[name]!r})" for name, value in changed.items())
        raise CapsNetError(f"--resume continues the checkpoint's {MODEL}; these flags change it: {listed}")
    if resumed.optimizer_state is None or resumed.scheduler_state is None:
        raise CapsNetError(f"{options.resume} holds no optimizer state to resume from")
    missing = [name for name in RECORDED if name not in resumed.metrics]
    if missing:
        raise CapsNetError(f"checkpoint {options.resume} is damaged: its metrics lack {', '.join(missing)}")
    if resumed.epoch >= options.epochs:
        raise CapsNetError(f"{options.resume} has already trained {resumed.epoch} epochs; pass --epochs above that")
    if resumed.epoch_progress is None:
        return EpochProgress()
    try:
        fields = dict(resumed.epoch_progress)
        recorded_plan = fields.pop("batch_plan")
        planned = {name: recorded_plan[name] for name in plan}
        progress = EpochProgress(**fields)
    except (KeyError, TypeError):
        raise CapsNetError(f"checkpoint {options.resume} is damaged: its progress into epoch {resumed.epoch + 1} "
                           "is incomplete") from None
    plan_changes = [SETTINGS[name].change(value, planned[name]) for name, value in plan.items()
                    if planned[name] != value]
    if plan_changes:
        raise CapsNetError(f"{options.resume} stopped {progress.step} steps into epoch {resumed.epoch + 1}; "
                           f"continuing that epoch needs its batches: {', '.join(plan_changes)}")
    return progress


def check_linear_schedule_steps(resumed: Checkpoint, options: RunOptions, progress: EpochProgress,
                                plan: dict[str, Any], steps: int) -> None:
    """A linear schedule is laid out in steps (--epochs times the `steps` of an epoch), and the resumed scheduler
    continues at its step count. Another number of steps an epoch (--batch-size, the training set, the processes)
    would put that count on a schedule of another length: the rate would jump, or sit at 0 for the epochs left."""
    done = (resumed.scheduler_state or {}).get("last_epoch")
    if options.lr_schedule != "linear" or not isinstance(done, int) or not resumed.epoch:
        return  # nothing to compare (a damaged state is reported when it is loaded)
    if done == resumed.epoch * steps + progress.step:
        return
    changes = [setting.change(plan[name], resumed.metrics[setting.metric]) for name, setting in SETTINGS.items()
               if setting.resume is Resume.EPOCH_END and setting.metric
               and resumed.metrics[setting.metric] != plan[name]]
    raise CapsNetError(f"{options.resume} follows a linear learning-rate schedule of "
                       f"{(done - progress.step) // resumed.epoch} steps an epoch; this run takes {steps}"
                       f"{': ' + ', '.join(changes) if changes else ''}")
