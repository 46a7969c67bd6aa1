"""`capsnet.v1.Image` -> float32 (C, H, W) in [0, 1], with errors that name the field at fault."""

from __future__ import annotations

import io
import math
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageFile, JpegImagePlugin, PngImagePlugin, UnidentifiedImageError

from capsnet.model_description.input_sizes import InputSizes
from capsnet.serving.errors import InvalidInput
from capsnet.v1 import capsnet_pb2 as pb

PIL_MODES = {1: "L", 3: "RGB"}  # model channels -> the PIL mode encoded images are converted to
TENSOR_DTYPES: dict[int, np.dtype] = {pb.DATA_TYPE_UINT8: np.dtype("u1"), pb.DATA_TYPE_FLOAT32: np.dtype("<f4")}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def max_encoded_bytes(shape: tuple[int, int, int]) -> int:
    """What the message limit budgets for one encoded image of at most `shape` (largest_encoded): 8-bit pixels of
    the model's channels, uncompressed (a PNG stored without compression; real images compress well below)."""
    channels, height, width = shape
    return height * (width * channels + 1)  # + 1: PNG's filter byte per row


def largest_encoded(sizes: InputSizes, shape: tuple[int, int, int], max_scale: int) -> tuple[int, int, int]:
    """(C, H, W) of the largest encoded image taken: `max_scale` times a fixed-size model's size (it is resized),
    a model of any size's largest (it is taken as it is, or refused)."""
    channels, height, width = shape
    return (channels, max_scale * height, max_scale * width) if sizes.fixed else sizes.largest


class Decoded(NamedTuple):
    """A request's images: each (C, H, W) float32 (sizes may differ for a model of any size), and the (H, W) an
    encoded image had where it was resized to the model's size (None: taken as it is)."""
    images: list[np.ndarray]
    resized_from: list[tuple[int, int] | None]


def decode_images(images, sizes: InputSizes, shape: tuple[int, int, int], max_scale: int) -> Decoded:
    """Repeated `Image` -> Decoded; values are checked later, by the service.

    A model of any size takes each image at its own size, which must be one of `sizes`. A fixed-size model of
    `shape` takes an encoded image of another size resized to fit, keeping its aspect ratio (bilinear, centred on
    black), and says so in `resized_from`; it may be at most `max_scale` times the model's height and width: the
    header says so before any pixel is decoded, so a small file declaring a huge canvas costs nothing.
    """
    decoded = Decoded([], [])
    for index, image in enumerate(images):
        field = f"images[{index}]"
        kind = image.WhichOneof("data")
        if kind == "encoded":
            pixels, resized_from = decode_encoded(image.encoded, f"{field}.encoded", sizes, shape, max_scale)
        elif kind == "tensor":
            pixels, resized_from = decode_tensor(image.tensor, f"{field}.tensor", sizes), None
        else:
            raise InvalidInput(f"{field}: no data; expected encoded (PNG/JPEG bytes) or tensor")
        decoded.images.append(pixels)
        decoded.resized_from.append(resized_from)
    return decoded


def decode_tensor(tensor: pb.Tensor, field: str, sizes: InputSizes) -> np.ndarray:
    dtype = TENSOR_DTYPES.get(tensor.dtype)
    if dtype is None:
        got = pb.DataType.Name(tensor.dtype) if tensor.dtype in pb.DataType.values() else str(tensor.dtype)
        raise InvalidInput(f"{field}.dtype: expected DATA_TYPE_UINT8 or DATA_TYPE_FLOAT32, got {got}")
    shape = tuple(tensor.shape)
    if len(shape) != 3 or shape not in sizes:
        expected = f"{list(sizes.largest)} (the model's C, H, W)" if sizes.fixed else f"[C, H, W] ({sizes.describe()})"
        raise InvalidInput(f"{field}.shape: expected {expected}, got {list(tensor.shape)}")
    expected_bytes = math.prod(shape) * dtype.itemsize
    if len(tensor.data) != expected_bytes:
        raise InvalidInput(f"{field}.data: expected {expected_bytes} bytes for {pb.DataType.Name(tensor.dtype)} shape "
                           f"{list(shape)}, got {len(tensor.data)}")
    values = np.frombuffer(tensor.data, dtype=dtype).reshape(shape)  # (C, H, W)
    if dtype == np.uint8:
        return values.astype(np.float32) / np.float32(255)
    return values


def decode_encoded(data: bytes, field: str, sizes: InputSizes, shape: tuple[int, int, int],
                   max_scale: int) -> tuple[np.ndarray, tuple[int, int] | None]:
    """PNG/JPEG -> the model's channels (L or RGB) -> [0, 1]; a fixed-size model's resized to fit H x W (keeping its
    aspect ratio), with the (H, W) it had, a model of any size's as it is."""
    channels, height, width = shape
    if channels not in PIL_MODES:
        raise InvalidInput(f"{field}: the model takes {channels}-channel input; send it as a tensor")
    _, limit_height, limit_width = largest_encoded(sizes, shape, max_scale)
    try:
        with Image.open(io.BytesIO(data), formats=["PNG", "JPEG"]) as image:  # reads the header only
            if not sizes.fixed and (channels, image.height, image.width) not in sizes:
                raise InvalidInput(f"{field}: a {image.width}x{image.height} image (width x height); the model takes "
                                   f"{sizes.describe()}")
            if image.width > limit_width or image.height > limit_height:
                raise _too_large(field, image.size, shape, max_scale)
            if image.format == "PNG" and _sixteen_bit(image):
                # PIL would cut 16-bit RGB to 8 bits and clip 16-bit grey to 0..255, not scale them
                raise InvalidInput(f"{field}: a 16-bit PNG; expected an 8-bit PNG or a JPEG, "
                                   "or send the pixels as a float32 tensor")
            converted = image.convert(PIL_MODES[channels])  # decodes
    except Image.DecompressionBombError:  # Pillow's own limit, met before ours when --max-image-scale is large
        size = _declared_size(data)
        if size[0] > limit_width or size[1] > limit_height:
            raise _too_large(field, size, shape, max_scale) from None
        assert Image.MAX_IMAGE_PIXELS is not None  # Pillow raises this error only when it has a limit
        raise InvalidInput(f"{field}: a {size[0]}x{size[1]} image is too large; expected at most "
                           f"{2 * Image.MAX_IMAGE_PIXELS} pixels (the image decoder's limit)") from None
    except UnidentifiedImageError:  # its text is only the repr of our BytesIO
        raise InvalidInput(f"{field}: cannot decode ({len(data)} bytes): expected a PNG or JPEG file") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise InvalidInput(f"{field}: cannot decode ({len(data)} bytes): expected a PNG or JPEG file "
                           f"({type(err).__name__}: {err})") from None
    resized_from = None
    if sizes.fixed and converted.size != (width, height):
        resized_from = (converted.height, converted.width)
        converted = fit(converted, width, height)
    pixels = np.asarray(converted, dtype=np.float32) / np.float32(255)  # (H, W) or (H, W, 3)
    if channels == 1:
        return pixels[None], resized_from  # (1, H, W)
    return pixels.transpose(2, 0, 1), resized_from  # (3, H, W)


def fit(image: Image.Image, width: int, height: int) -> Image.Image:
    """`image` scaled (bilinear) to fit width x height keeping its aspect ratio, centred on black: a 28x56 pair of
    digits becomes a 14x28 strip in a 28x28 image, not two squashed digits."""
    scale = min(width / image.width, height / image.height)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    canvas = Image.new(image.mode, (width, height))  # black
    canvas.paste(image.resize(size, Image.Resampling.BILINEAR), ((width - size[0]) // 2, (height - size[1]) // 2))
    return canvas


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
