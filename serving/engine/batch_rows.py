"""A batch's rows, moved in the batch thread: the images of the requests it takes gathered into one array (from
memory, from clients' shared-memory regions, or on the backend's device), the backend's run on it, and each request's
rows of the outputs handed over, written into its sinks or copied into its own arrays.

A batch is a list of parts, (request, start, stop): the request's images [start, stop), in the batch's order
(serving/engine/batcher.py cuts them from its queue).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

import numpy as np

from capsnet.serving.engine.backend_registry import device_input
from capsnet.serving.engine.backends.base import Backend
from capsnet.serving.engine.cuda_ipc import DeviceInput
from capsnet.serving.errors import ServingError

if TYPE_CHECKING:
    import torch

    from capsnet.serving.engine.batcher import QueuedRequest


def gather_and_run(backend: Backend, parts: list[tuple[QueuedRequest, int, int]]):
    """In the worker thread: the batch's images in one array, read from memory or from their regions, the
    backend's run on it, and the outputs requests sink; (outputs, [(request, why it failed)], run start, run end).
    A whole request already in memory is run as it is, without a copy. A backend that takes device input
    (cuda_ipc.DeviceInput) gets a batch with images from CUDA regions on its device, copied device to device, and
    its outputs go to the sinks from the device."""
    unread: list[tuple[QueuedRequest, ServingError]] = []
    device = device_input(backend)  # the backend table's row says whether it takes a batch on its GPU
    run_device = device.run_device if device is not None else None
    if run_device is not None and any(not isinstance(request.images, np.ndarray) and request.images.on_device
                                      for request, _, _ in parts):
        batch = gather_on_device(backend, parts, unread)
        started = time.monotonic()
        on_device = run_device(batch)
        ended = time.monotonic()
        sink_rows(parts, on_device, unread)
        return {name: tensor.cpu().numpy() for name, tensor in on_device.items()}, unread, started, ended
    first, start, stop = parts[0]
    if len(parts) == 1 and isinstance(first.images, np.ndarray) and stop - start == len(first.images):
        images = first.images
    else:
        size = sum(stop - start for _, start, stop in parts)
        images = np.empty((size, *first.images.shape[1:]), dtype=np.float32)  # (B, C, H, W)
        offset = 0
        for request, start, stop in parts:
            rows = images[offset:offset + stop - start]
            offset += stop - start
            if isinstance(request.images, np.ndarray):
                rows[...] = request.images[start:stop]
                continue
            try:
                request.images.read(rows, start, stop)
            except ServingError as err:
                rows[...] = 0  # run with the batch, its rows unanswered
                unread.append((request, err))
    started = time.monotonic()
    outputs = backend.run(images)
    ended = time.monotonic()
    sink_rows(parts, outputs, unread)
    return outputs, unread, started, ended


def sink_rows(parts: list[tuple[QueuedRequest, int, int]], outputs: dict, failed: list) -> None:
    """Each request's rows of the outputs it sinks, written there (numpy or CUDA tensors, as the backend gave)."""
    offset = 0
    for request, start, stop in parts:
        rows = slice(offset, offset + stop - start)
        offset += stop - start
        if not request.sinks or any(request is done for done, _ in failed):
            continue
        try:
            for name, sink in request.sinks.items():
                sink.write(outputs[name][rows], start)
        except ServingError as err:
            failed.append((request, err))


def gather_on_device(backend: Backend, parts: list[tuple[QueuedRequest, int, int]], unread: list) -> torch.Tensor:
    """The batch as a float32 CUDA tensor on the backend's device (B, C, H, W)."""
    import torch

    first = parts[0][0].images
    size = sum(stop - start for _, start, stop in parts)
    device = cast(DeviceInput, backend).device
    batch = torch.empty((size, *first.shape[1:]), dtype=torch.float32, device=device)
    offset = 0
    for request, start, stop in parts:
        rows = batch[offset:offset + stop - start]
        offset += stop - start
        if isinstance(request.images, np.ndarray):
            rows.copy_(torch.from_numpy(np.ascontiguousarray(request.images[start:stop])))
            continue
        try:
            request.images.read_device(rows, start, stop)
        except ServingError as err:
            rows.zero_()
            unread.append((request, err))
    return batch


def copy_rows(parts: list[tuple[QueuedRequest, int, int]], outputs: dict[str, np.ndarray]) -> list[QueuedRequest]:
    """Copy each request's rows of the batch outputs into its own arrays; the requests still waiting for them. A
    batch of one whole request hands it the batch's outputs, which are the batcher's to keep (Backend.run)."""
    if len(parts) == 1 and parts[0][1] == 0 and parts[0][2] == len(parts[0][0].images):
        request = parts[0][0]
        if request.future.done():
            return []
        request.outputs = {name: array for name, array in outputs.items() if name not in request.sinks}
        request.done = len(request.images)
        return [request]
    offset = 0
    copied = []
    for request, start, stop in parts:
        rows = slice(offset, offset + stop - start)
        offset += stop - start
        if request.future.done():  # cancelled or timed out meanwhile
            continue
        for name, array in outputs.items():
            if name in request.sinks:
                continue
            if name not in request.outputs:
                request.outputs[name] = np.empty((len(request.images), *array.shape[1:]), dtype=array.dtype)
            request.outputs[name][start:stop] = array[rows]
        request.done += stop - start
        copied.append(request)
    return copied
