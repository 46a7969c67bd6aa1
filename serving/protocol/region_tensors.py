"""A request's tensors in clients' shared-memory regions (Triton's system and CUDA shared-memory extensions), as the
batcher reads and writes them: images read straight into the batch (batcher.ImageSource), outputs written straight
from the batch (batcher.OutputSink). The data plane (serving/protocol/kserve.py) names the regions and holds them until
the request is answered; each read or write holds its region again.
"""

from __future__ import annotations

import math

import numpy as np

from capsnet.serving.engine.service import check_values
from capsnet.serving.errors import InvalidInput
from capsnet.serving.protocol.shared_memory import CUDA, CudaRegion, Region, RegionRef


class RegionImages:
    """A request's images in a shared-memory region, read by the batcher straight into its batch (ImageSource): the
    region stays held by the request, and is held again for each read."""

    def __init__(self, region: Region, offset: int, shape: tuple[int, ...], datatype: str, dtype: np.dtype,
                 field: str):
        """`shape` (N, C, H, W) of `datatype` (FP32, or UINT8 pixels scaled by 1/255), stored as `dtype`."""
        self.region = region
        self.offset = offset
        self.shape = shape
        self.datatype, self.dtype = datatype, dtype
        self.field = field

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, out: np.ndarray, start: int, stop: int) -> None:
        """Images [start, stop) into `out` (float32, contiguous), checked as any request's values."""
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        with self.region.in_use(self.field):
            if self.datatype == "FP32":
                self.region.read(out, self.offset + start * row_bytes, self.field)
            else:
                pixels = np.empty(out.shape, dtype=self.dtype)
                self.region.read(pixels, self.offset + start * row_bytes, self.field)
                np.divide(pixels, np.float32(255), out=out)
        check_values(out, self.field, first=start)

    @property
    def on_device(self) -> bool:
        return self.region.kind == CUDA

    def read_device(self, out, start: int, stop: int) -> None:
        """Images [start, stop) into `out`, a float32 CUDA tensor: from a CUDA region device to device, checked there
        (on the host only to name a bad image); from a system region through the host."""
        import torch

        if not isinstance(self.region, CudaRegion):
            rows = np.empty(tuple(out.shape), dtype=np.float32)
            self.read(rows, start, stop)
            out.copy_(torch.from_numpy(rows))
            return
        itemsize = self.dtype.itemsize
        count = out.numel()
        with self.region.in_use(self.field):
            source = self.region.buffer.view(self.offset + start * (count // len(out)) * itemsize, count * itemsize)
            if self.datatype == "FP32":
                out.reshape(-1).view(source.dtype).copy_(source)  # device to device, bytes for bytes
            else:
                out.copy_(source.view(out.shape).float().div_(255))
        low, high = out.aminmax()
        if not (0 <= low.item() and high.item() <= 1):  # False with NaN
            check_values(out.cpu().numpy(), self.field, first=start)


class RegionOutput:
    """A requested output's region, as the batcher writes it (OutputSink): row by row at the request's offset, held
    for each write."""

    def __init__(self, region: Region, offset: int, row_shape: tuple[int, ...], field: str):
        self.region = region
        self.offset = offset
        self.row_bytes = math.prod(row_shape) * 4  # float32
        self.field = field

    def write(self, rows, start: int) -> None:
        offset = self.offset + start * self.row_bytes
        with self.region.in_use(self.field):
            if isinstance(rows, np.ndarray):
                self.region.write(np.ascontiguousarray(rows, dtype="<f4"), offset, self.field)
            else:
                self.region.write_device(rows, offset, self.field)


def check_room(ref: RegionRef, size: int, shape: tuple[int, ...], field: str) -> None:
    if ref.byte_size < size:
        raise InvalidInput(f"{field}.parameters.shared_memory_byte_size: {ref.byte_size} bytes cannot hold the output "
                           f"of shape {list(shape)} ({size} bytes)")
