"""`capsnet.v1.Image` -> float32 (C, H, W) in [0, 1], with errors that name the field at fault."""

from __future__ import annotations

import io
import math

import grpc
import numpy as np
from PIL import Image, UnidentifiedImageError

from capsnet.serving.errors import ServingError
from capsnet.v1 import capsnet_pb2 as pb

# Encoded images larger than this are refused before their pixels are decoded: a small PNG can
# declare a huge canvas ("decompression bomb"); 4096x4096 is far beyond any CapsNet input.
MAX_ENCODED_PIXELS = 4096 * 4096
PIL_MODES = {1: "L", 3: "RGB"}  # model channels -> the PIL mode encoded images are converted to
TENSOR_DTYPES = {pb.DATA_TYPE_UINT8: np.dtype("u1"), pb.DATA_TYPE_FLOAT32: np.dtype("<f4")}


def _invalid(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, message)


def decode_images(images, shape: tuple[int, int, int]) -> np.ndarray:
    """Repeated `Image` -> (N, C, H, W) float32; values are checked later, by the service."""
    batch = np.empty((len(images), *shape), dtype=np.float32)  # (N, C, H, W)
    for index, image in enumerate(images):
        field = f"images[{index}]"
        kind = image.WhichOneof("data")
        if kind == "encoded":
            batch[index] = decode_encoded(image.encoded, f"{field}.encoded", shape)
        elif kind == "tensor":
            batch[index] = decode_tensor(image.tensor, f"{field}.tensor", shape)
        else:
            raise _invalid(f"{field}: no data; expected encoded (PNG/JPEG bytes) or tensor")
    return batch


def decode_tensor(tensor: pb.Tensor, field: str, shape: tuple[int, int, int]) -> np.ndarray:
    dtype = TENSOR_DTYPES.get(tensor.dtype)
    if dtype is None:
        got = pb.DataType.Name(tensor.dtype) if tensor.dtype in pb.DataType.values() else str(tensor.dtype)
        raise _invalid(f"{field}.dtype: expected DATA_TYPE_UINT8 or DATA_TYPE_FLOAT32, got {got}")
    if tuple(tensor.shape) != shape:
        raise _invalid(f"{field}.shape: expected {list(shape)} (the model's C, H, W), got {list(tensor.shape)}")
    expected = math.prod(shape) * dtype.itemsize
    if len(tensor.data) != expected:
        raise _invalid(f"{field}.data: expected {expected} bytes for {pb.DataType.Name(tensor.dtype)} shape "
                       f"{list(shape)}, got {len(tensor.data)}")
    values = np.frombuffer(tensor.data, dtype=dtype).reshape(shape)  # (C, H, W)
    if dtype == np.uint8:
        return values.astype(np.float32) / np.float32(255)
    return values


def decode_encoded(data: bytes, field: str, shape: tuple[int, int, int]) -> np.ndarray:
    """PNG/JPEG -> the model's channels (L or RGB) -> resized to H x W (bilinear) -> [0, 1]."""
    channels, height, width = shape
    if channels not in PIL_MODES:
        raise _invalid(f"{field}: the model takes {channels}-channel input; send it as a tensor")
    try:
        with Image.open(io.BytesIO(data), formats=["PNG", "JPEG"]) as image:
            if image.width * image.height > MAX_ENCODED_PIXELS:
                raise _invalid(f"{field}: a {image.width}x{image.height} image is too large; "
                               f"expected at most {MAX_ENCODED_PIXELS} pixels")
            if image.mode.startswith(("I", "F")):  # PIL would clip these to 0..255, not scale them
                raise _invalid(f"{field}: {image.mode} pixels (16-bit or float PNG); expected 8-bit PNG or JPEG, "
                               "or send a float32 tensor")
            converted = image.convert(PIL_MODES[channels])  # decodes
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise _invalid(f"{field}: cannot decode ({len(data)} bytes): expected a PNG or JPEG file "
                       f"({type(err).__name__}: {err})") from None
    if converted.size != (width, height):
        converted = converted.resize((width, height), Image.Resampling.BILINEAR)
    pixels = np.asarray(converted, dtype=np.float32) / np.float32(255)  # (H, W) or (H, W, 3)
    if channels == 1:
        return pixels[None]  # (1, H, W)
    return pixels.transpose(2, 0, 1)  # (3, H, W)
