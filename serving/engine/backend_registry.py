"""The server's view of the backend table (capsnet/model_description/backend_table.py): the names `--backend` takes,
the class a row's backends are made from, and what a loaded backend takes from CUDA memory.

The classes are imported only when a backend is made, so a CPU server never imports torch or TensorRT.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from capsnet.model_description.backend_table import BACKEND_TABLE, BackendRow

if TYPE_CHECKING:
    from capsnet.serving.engine.backends.base import Backend
    from capsnet.serving.engine.cuda_ipc import DeviceInput

BACKEND_KINDS: dict[str, BackendRow] = BACKEND_TABLE


def backend_class(name: str) -> type[Backend]:
    row = BACKEND_TABLE[name]
    return getattr(importlib.import_module(row.module), row.class_name)


def takes_cuda_shared_memory(backend: Backend) -> bool:
    """Whether `backend` serves on a GPU and takes images from CUDA shared-memory regions there."""
    return backend.on_gpu and BACKEND_TABLE[backend.name].cuda_shared_memory


def device_input(backend: Backend) -> DeviceInput | None:
    """`backend` as one that runs a batch already on its GPU, where its row says it does and it serves on a GPU."""
    return cast("DeviceInput", backend) if backend.on_gpu and BACKEND_TABLE[backend.name].device_input else None
