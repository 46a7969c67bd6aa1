"""One epoch of training: this rank's shuffled batches, their random augmentation, and the steps over them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from capsnet.errors import CapsNetError
from capsnet.training import distributed
from capsnet.training.data import Augmentation, to_float
from capsnet.training.distributed import DistributedContext
from capsnet.training.loss import capsnet_loss
from capsnet.training.resume import EpochProgress
from capsnet.training.run import EpochResult, Training


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


def epoch_steps(num_images: int, batch_size: int, context: DistributedContext) -> int:
    """Batches per epoch on each rank (the same on every rank)."""
    return len(epoch_batches(num_images, batch_size // context.world_size, context, 0, 0))


def augmentation_generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    """Shifts differ across epochs and ranks, and repeat exactly on --resume."""
    generator = torch.Generator()
    generator.manual_seed(int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0]))
    return generator


def autocast_context(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16)


def train_one_epoch(training: Training, epoch: int, progress: EpochProgress,
                    save_progress: Callable[[int, EpochProgress], None]) -> EpochResult:
    """One pass of `training.step_model` over this rank's share of the training split, from `progress.step` on; the
    loss and accuracy returned are summed over ranks. Every `options.checkpoint_every` steps, `save_progress` gets
    the progress so far. A linear schedule steps after every batch here; an exponential one is the caller's, per
    epoch."""
    run, state, step_model = training.run, training.state, training.step_model
    options, config, context, device, split = run.options, run.config, run.context, run.device, run.dataset.train
    optimizer, scheduler, scaler = state.optimizer, state.scheduler, state.scaler
    batches = epoch_batches(len(split), run.per_rank_batch, context, options.seed, epoch)
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
