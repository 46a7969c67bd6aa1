"""`capsnet.v1.Image` -> float32 (C, H, W) in [0, 1], with errors that name the field at fault."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageFile, JpegImagePlugin, PngImagePlugin, UnidentifiedImageError

from capsnet.serving.errors import InvalidInput
from capsnet.v1 import capsnet_pb2 as pb

PIL_MODES = {1: "L", 3: "RGB"}  # model channels -> the PIL mode encoded images are converted to
TENSOR_DTYPES: dict[int, np.dtype] = {pb.DATA_TYPE_UINT8: np.dtype("u1"), pb.DATA_TYPE_FLOAT32: np.dtype("<f4")}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def max_encoded_bytes(shape: tuple[int, int, int], max_scale: int) -> int:
    """What the message limit budgets for one encoded image: the largest accepted canvas as 8-bit pixels of
    the model's channels, uncompressed (a PNG stored without compression; real images compress well below)."""
    channels, height, width = shape
    return (max_scale * height) * (max_scale * width * channels + 1)  # + 1: PNG's filter byte per row


def decode_images(images, shape: tuple[int, int, int], max_scale: int) -> np.ndarray:
    """Repeated `Image` -> (N, C, H, W) float32; values are checked later, by the service.

    Encoded images may be at most `max_scale` times the model's height and width: the header says
    so before any pixel is decoded, so a small file declaring a huge canvas costs nothing.
    """
    batch = np.empty((len(images), *shape), dtype=np.float32)  # (N, C, H, W)
    for index, image in enumerate(images):
        field = f"images[{index}]"
        kind = image.WhichOneof("data")
        if kind == "encoded":
            batch[index] = decode_encoded(image.encoded, f"{field}.encoded", shape, max_scale)
        elif kind == "tensor":
            batch[index] = decode_tensor(image.tensor, f"{field}.tensor", shape)
        else:
            raise InvalidInput(f"{field}: no data; expected encoded (PNG/JPEG bytes) or tensor")
    return batch


def decode_tensor(tensor: pb.Tensor, field: str, shape: tuple[int, int, int]) -> np.ndarray:
    dtype = TENSOR_DTYPES.get(tensor.dtype)
    if dtype is None:
        got = pb.DataType.Name(tensor.dtype) if tensor.dtype in pb.DataType.values() else str(tensor.dtype)
        raise InvalidInput(f"{field}.dtype: expected DATA_TYPE_UINT8 or DATA_TYPE_FLOAT32, got {got}")
    if tuple(tensor.shape) != shape:
        raise InvalidInput(f"{field}.shape: expected {list(shape)} (the model's C, H, W), got {list(tensor.shape)}")
    expected = math.prod(shape) * dtype.itemsize
    if len(tensor.data) != expected:
        raise InvalidInput(f"{field}.data: expected {expected} bytes for {pb.DataType.Name(tensor.dtype)} shape "
                           f"{list(shape)}, got {len(tensor.data)}")
    values = np.frombuffer(tensor.data, dtype=dtype).reshape(shape)  # (C, H, W)
    if dtype == np.uint8:
        return values.astype(np.float32) / np.float32(255)
    return values


def decode_encoded(data: bytes, field: str, shape: tuple[int, int, int], max_scale: int) -> np.ndarray:
    """PNG/JPEG -> the model's channels (L or RGB) -> resized to H x W (bilinear) -> [0, 1]."""
    channels, height, width = shape
    if channels not in PIL_MODES:
        raise InvalidInput(f"{field}: the model takes {channels}-channel input; send it as a tensor")
    try:
        with Image.open(io.BytesIO(data), formats=["PNG", "JPEG"]) as image:  # reads the header only
            if image.width > max_scale * width or image.height > max_scale * height:
                raise _too_large(field, image.size, shape, max_scale)
            if image.format == "PNG" and _sixteen_bit(image):
                # PIL would cut 16-bit RGB to 8 bits and clip 16-bit grey to 0..255, not scale them
                raise InvalidInput(f"{field}: a 16-bit PNG; expected an 8-bit PNG or a JPEG, "
                                   "or send the pixels as a float32 tensor")
            converted = image.convert(PIL_MODES[channels])  # decodes
    except Image.DecompressionBombError:  # Pillow's own limit, met before ours when --max-image-scale is large
        size = _declared_size(data)
        if size[0] > max_scale * width or size[1] > max_scale * height:
            raise _too_large(field, size, shape, max_scale) from None
        assert Image.MAX_IMAGE_PIXELS is not None  # Pillow raises this error only when it has a limit
        raise InvalidInput(f"{field}: a {size[0]}x{size[1]} image is too large; expected at most "
                           f"{2 * Image.MAX_IMAGE_PIXELS} pixels (the image decoder's limit)") from None
    except UnidentifiedImageError:  # its text is only the repr of our BytesIO
        raise InvalidInput(f"{field}: cannot decode ({len(data)} bytes): expected a PNG or JPEG file") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise InvalidInput(f"{field}: cannot decode ({len(data)} bytes): expected a PNG or JPEG file "
                           f"({type(err).__name__}: {err})") from None
    if converted.size != (width, height):
        converted = converted.resize((width, height), Image.Resampling.BILINEAR)
    pixels = np.asarray(converted, dtype=np.float32) / np.float32(255)  # (H, W) or (H, W, 3)
    if channels == 1:
        return pixels[None]  # (1, H, W)
    return pixels.transpose(2, 0, 1)  # (3, H, W)


def _sixteen_bit(image: ImageFile.ImageFile) -> bool:
    """Whether Pillow will read 16-bit samples: its raw mode says so ("I;16B", "RGB;16B", ...), wherever the file
    put its IHDR chunk (Pillow accepts chunks before it)."""
    return any(isinstance(tile.args, str) and ";16" in tile.args for tile in image.tile)


def _too_large(field: str, size: tuple[int, int], shape: tuple[int, int, int], max_scale: int) -> InvalidInput:
    _, height, width = shape
    return InvalidInput(f"{field}: a {size[0]}x{size[1]} image is too large; expected at most "
                        f"{max_scale * width}x{max_scale * height} ({max_scale}x the model's "
                        f"{width}x{height}, --max-image-scale)")


def _declared_size(data: bytes) -> tuple[int, int]:
    """The width and height an image's header declares, read by the format's plugin itself: unlike
    Image.open, it does not apply Pillow's decompression bomb limit."""
    plugin = PngImagePlugin.PngImageFile if data.startswith(PNG_SIGNATURE) else JpegImagePlugin.JpegImageFile
    with plugin(io.BytesIO(data)) as image:
        return image.size
