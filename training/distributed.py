"""One code path for one process or many: torchrun describes the process group in the environment.

Under `torchrun --nproc_per_node=N`, every process runs the same `capsnet train`; this module reads
its rank, picks its device, joins the process group (NCCL on CUDA, gloo on CPU) and sums statistics
across ranks; a user mistake, or a peer that dies, ends every rank with one line instead of N or a traceback.
Alone, the context is rank 0 of 1 and every collective is a no-op.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from capsnet.errors import CapsNetError


class ReportedError(CapsNetError):
    """A user error that rank 0 has already printed for the whole run; `capsnet train` exits 2 without a word."""


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main process prints and writes checkpoints."""
        return self.rank == 0


def _environment_int(variable: str, default: int) -> int:
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise CapsNetError(f"environment variable {variable}={raw!r} is not an integer") from None


def context_from_environment() -> DistributedContext:
    """The variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); absent: a single process."""
    context = DistributedContext(
        rank=_environment_int("RANK", 0),
        local_rank=_environment_int("LOCAL_RANK", 0),
        world_size=_environment_int("WORLD_SIZE", 1),
        local_world_size=_environment_int("LOCAL_WORLD_SIZE", 1),
    )
    if not 0 <= context.rank < context.world_size:
        raise CapsNetError(f"RANK={context.rank} is outside WORLD_SIZE={context.world_size}")
    return context


def resolve_device(spec: str, context: DistributedContext) -> torch.device:
    """`auto` (CUDA if present, else CPU), `cpu`, `cuda` or `cuda:N`; under torchrun, `cuda` means cuda:LOCAL_RANK."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise CapsNetError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise CapsNetError(f"unsupported device {spec!r}; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise CapsNetError(f"device {spec!r} requested but this machine has no usable CUDA GPU")
    if device.index is not None and context.local_world_size > 1:
        raise CapsNetError("under torchrun each process uses cuda:LOCAL_RANK; pass --device cuda or auto")
    index = context.local_rank if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise CapsNetError(f"device cuda:{index} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@contextmanager
def process_group(context: DistributedContext, device: torch.device) -> Iterator[None]:
    """Join the torchrun process group for the duration (MASTER_ADDR/MASTER_PORT come from the environment)."""
    if not context.is_distributed:
        yield
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise CapsNetError(f"WORLD_SIZE={context.world_size} asks for a process group but {' and '.join(missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} not set: start the run with torchrun, or unset "
                           "WORLD_SIZE")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if context.is_main:  # otherwise a stray WORLD_SIZE waits in silence for peers that never come
        print(f"waiting for {context.world_size} processes at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
              file=sys.stderr, flush=True)
    # torch.distributed.nn.functional binds `group.WORLD` as default arguments when it is imported, and torch._dynamo
    # imports it, which the first optimizer imports: imported inside the group, its ten functions held the group past
    # destroy_process_group. gloo has no shutdown of its own (its group ends when its last reference goes), so its
    # threads outlived `train()` into interpreter shutdown, where a rank now and then aborted (SIGABRT, "terminate
    # called without an active exception") instead of exiting with its code. Imported before the group, they hold None.
    import torch.distributed.nn.functional  # noqa: F401

    try:
        dist.init_process_group(backend, rank=context.rank, world_size=context.world_size,
                                device_id=device if device.type == "cuda" else None)
    except (RuntimeError, ValueError) as err:  # torch's DistError (timeouts, refused store) is a RuntimeError
        raise CapsNetError(f"cannot join the process group of {context.world_size}: "
                           f"{str(err).splitlines()[0]}") from None
    try:
        yield
        # Every rank leaves the group together: a rank that ended its process while a peer was still in the group
        # (rank 0 writing the last checkpoints) aborted in gloo's teardown now and then (SIGABRT, "terminate called
        # without an active exception"), failing a run whose training had succeeded.
        dist.barrier()
    except RuntimeError as err:
        # A peer that exits (its own error, a kill) breaks the next collective here: say so in one line, not a traceback
        if not _peer_lost(err):
            raise
        # gloo's work still pending with the dead peer (DDP's gradient all-reduce) waits for it up to the group's
        # 30-minute timeout, and the group's teardown waits for that work: with the group destroyed for real, the
        # surviving rank hung there instead of exiting. The run is over, so this rank says its one line and leaves
        # at once, without tearing down the group or the interpreter (which could abort with gloo alive).
        print(f"capsnet train: error: process {context.rank} of {context.world_size} stopped: another process of "
              f"the run ended (its error, if it had one, is above): {_first_sentence(err)}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        os._exit(2)
    finally:
        dist.destroy_process_group()


def _peer_lost(err: RuntimeError) -> bool:
    """gloo raises a plain RuntimeError when a peer's connection drops; the store, a DistNetworkError."""
    message = str(err)
    return isinstance(err, dist.DistNetworkError) or any(
        words in message for words in ("closed by peer", "reset by peer", "remote worker"))


def _first_sentence(err: Exception) -> str:
    """'[.../pair.cc:553] Connection closed by peer [127.0.0.1]:2475. This is ...' -> 'Connection closed by peer ...'"""
    text = str(err).strip() or type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". ")[0]


@contextmanager
def errors_reported_once(context: DistributedContext, command: str = "capsnet train") -> Iterator[None]:
    """Run a user-error check on every rank; if any rank's fails, all fail together with one line from rank 0.

    Every rank of torchrun runs the same checks, so a mistake would print N identical lines; a mistake on one rank
    only (a data folder missing on one node) would stop that rank and leave the others waiting in the next collective
    for up to the group's 30-minute timeout. So the ranks exchange their outcome: rank 0 prints the first failing
    rank's error (naming the rank unless every rank failed alike) before a barrier, since torchrun stops the others as
    soon as one exits, and then every rank raises ReportedError.
    """
    if not context.is_distributed:
        yield
        return
    error = None
    try:
        yield
    except CapsNetError as err:
        error = str(err)
    errors: list[str | None] = [None] * context.world_size
    dist.all_gather_object(errors, error)
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if not failed:
        return
    rank, message = failed[0]
    if len(failed) < context.world_size or any(other != message for _, other in failed):
        message = f"process {rank} of {context.world_size}: {message}"
    if context.is_main:
        print(f"{command}: error: {message}", file=sys.stderr, flush=True)
    dist.barrier()
    raise ReportedError(message)


def check_same_on_every_rank(context: DistributedContext, what: str, value: dict[str, object]) -> None:
    """Raise the same CapsNetError on every rank if `value` differs between ranks (name its first differing entry).

    Each rank reads its own copy of the data; copies that differ (another version on one node) would give the ranks
    other splits and other numbers of steps, and a rank that finishes its epoch first waits for the others forever.
    """
    if not context.is_distributed:
        return
    values: list[dict[str, object] | None] = [None] * context.world_size
    dist.all_gather_object(values, value)
    gathered = [other for other in values if other is not None]  # all_gather_object filled every slot
    for rank, other in enumerate(gathered):
        for key, mine in gathered[0].items():
            if other[key] != mine:
                raise CapsNetError(f"the processes' {what} differ: {key} {mine} in process 0 but {other[key]} in "
                                   f"process {rank} of {context.world_size}; give every process the same")


def all_reduce_sum(values: Tensor, context: DistributedContext) -> Tensor:
    """Sum `values` over all ranks, in place (NCCL needs them on the rank's GPU)."""
    if context.is_distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values
