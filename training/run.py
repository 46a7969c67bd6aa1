"""One run of `capsnet train` as typed records: what it trains with (Run), what it trains and a checkpoint keeps
(TrainingState), and both under way (Training); and how the state is made, restored and written into a checkpoint."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from capsnet.errors import CapsNetError
from capsnet.models.capsnet import count_parameters
from capsnet.models.checkpoint import Checkpoint, Model, create_model
from capsnet.models.config import CapsNetConfig
from capsnet.training import distributed
from capsnet.training.data import Dataset, data_location
from capsnet.training.distributed import DistributedContext
from capsnet.training.history import EpochRecord
from capsnet.training.optimizer import parameter_groups
from capsnet.training.options import RunOptions
from capsnet.training.resume import EpochProgress


@dataclass(frozen=True)
class Run:
    """What every epoch of a run shares: its settings, the model's, its data, where it runs and where it starts."""
    options: RunOptions
    config: CapsNetConfig
    dataset: Dataset
    context: DistributedContext
    device: torch.device
    resumed: Checkpoint | None = None  # the checkpoint it continues
    start: EpochProgress = field(default_factory=EpochProgress)  # how far into its next epoch `resumed` got

    @property
    def per_rank_batch(self) -> int:
        return self.options.batch_size // self.context.world_size


@dataclass
class TrainingState:
    """What a run trains and a checkpoint keeps: the model, its optimizer, learning-rate schedule and loss scaling,
    and a record of every epoch so far."""
    model: Model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    history: list[EpochRecord] = field(default_factory=list)


@dataclass(frozen=True)
class Training:
    """A run under way: its state, what the training steps call, and what every checkpoint records of it."""
    run: Run
    state: TrainingState
    step_model: torch.nn.Module  # state.model, in DistributedDataParallel under torchrun, compiled with --compile
    info: dict[str, Any]  # run_info
    plan: dict[str, Any]  # resume.batch_plan: what a checkpoint written mid-epoch needs to continue it


@dataclass
class EpochResult:
    loss: float
    accuracy: float
    images: int
    seconds: float


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


def new_state(run: Run, steps_per_epoch: int) -> TrainingState:
    """A model initialised from --seed, with a fresh optimizer, schedule and loss scaling."""
    options, device = run.options, run.device
    torch.manual_seed(options.seed)
    model = create_model(run.config).to(device)
    optimizer = torch.optim.Adam(parameter_groups(model, options.lr), lr=options.lr)
    scheduler = learning_rate_scheduler(optimizer, options, steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=options.amp and device.type == "cuda")
    return TrainingState(model, optimizer, scheduler, scaler)


def restore(state: TrainingState, run: Run) -> None:
    """Load the resumed run's weights, optimizer, schedule, loss scaling and history into `state`."""
    resumed = run.resumed
    assert resumed is not None
    with distributed.errors_reported_once(run.context):  # every rank loads the same file: one line, not N
        state.model.load_state_dict(resumed.state_dict)
        # check_resumable refused a checkpoint without them
        assert resumed.optimizer_state is not None and resumed.scheduler_state is not None
        try:  # load_checkpoint checked that these are dicts, not what they hold
            state.optimizer.load_state_dict(resumed.optimizer_state)
            state.scheduler.load_state_dict(resumed.scheduler_state)
            if resumed.scaler_state:  # empty when the run had no CUDA mixed precision
                state.scaler.load_state_dict(resumed.scaler_state)
        except (KeyError, TypeError, ValueError) as err:
            raise CapsNetError(f"checkpoint {run.options.resume} is damaged: its optimizer state does not load "
                               f"({type(err).__name__}: {err})") from None
    state.history = [EpochRecord.from_dict(record) for record in resumed.history]


def step_model_for(model: Model, run: Run) -> torch.nn.Module:
    """What the training steps call: `model`, in DistributedDataParallel under torchrun, compiled with --compile."""
    if run.context.is_distributed:
        # A 1-channel Conv1 weight (256, 1, 9, 9) gets its gradient with another (equivalent) stride for the
        # size-1 axis; DDP warns about it on every backward though nothing is wrong.
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    step_model: torch.nn.Module = DistributedDataParallel(model) if run.context.is_distributed else model
    if run.options.compile:
        step_model = cast(torch.nn.Module, torch.compile(step_model))  # an OptimizedModule, which is a Module
    return step_model


def run_info(run: Run, model: Model) -> dict[str, Any]:
    """What every checkpoint of the run records about it beside the epoch's figures."""
    options, dataset = run.options, run.dataset
    return {
        # where the data is, so `capsnet export` calibrates and gates INT8 on the model's own data by default
        "dataset": dataset.name, "data": data_location(options.data),
        "train_images": len(dataset.train), "test_images": len(dataset.test),
        "validation_images": len(dataset.validation or ()), "validation_fraction": dataset.validation_fraction,
        "parameters": count_parameters(model), "batch_size": options.batch_size, "initial_lr": options.lr,
        "lr_schedule": options.lr_schedule, "lr_decay": options.lr_decay, "warmup": options.warmup,
        "epochs": options.epochs, "max_shift": options.max_shift, "hflip": options.hflip, "erase": options.erase,
        "seed": options.seed, "device": run.device.type, "world_size": run.context.world_size, "amp": options.amp,
        "compile": options.compile,
    }


def snapshot(training: Training, epochs_done: int, metrics: dict, partial: EpochProgress | None = None) -> Checkpoint:
    """The checkpoint of `training` after `epochs_done` epochs, and `partial`'s steps into the next one."""
    state = training.state
    return Checkpoint(
        config=training.run.config, state_dict=state.model.state_dict(),
        class_names=list(training.run.dataset.class_names), metrics=metrics, epoch=epochs_done,
        optimizer_state=state.optimizer.state_dict(), scheduler_state=state.scheduler.state_dict(),
        history=[record.to_dict() for record in state.history], dataset=training.run.dataset.name,
        scaler_state=state.scaler.state_dict(),
        epoch_progress=None if partial is None else {**asdict(partial), "batch_plan": training.plan},
    )
