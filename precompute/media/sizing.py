"""The geometry of preparing media: aspect-ratio buckets at a pixel budget (``bucket_sizes``,
``size_for_aspect``), and the centred crop box with the target's aspect that is then resized to
it (``center_crop_box``, ``crop_and_resize``). Which bucket a source goes to, by the encoder's
size rule, is ``precompute.media.decode.choose_size``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image


def bucket_sizes(target_area: int, multiple: int, aspect_ratios: list[float] | tuple[float, ...]) -> list[tuple[int, int]]:
    """(width, height) per aspect ratio, each side a multiple of ``multiple``, area ~ target_area."""
    sizes = {size_for_aspect(target_area, multiple, ratio) for ratio in aspect_ratios}
    return sorted(sizes)


def center_crop_box(orig_width: int, orig_height: int, width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, crop_width, crop_height): the largest centred box with the target's aspect."""
    target_aspect = width / height
    if orig_width / orig_height > target_aspect:  # source is wider: keep full height
        crop_height = orig_height
        crop_width = min(orig_width, max(1, round(orig_height * target_aspect)))
    else:
        crop_width = orig_width
        crop_height = min(orig_height, max(1, round(orig_width / target_aspect)))
    return (orig_width - crop_width) // 2, (orig_height - crop_height) // 2, crop_width, crop_height


def crop_and_resize(image: Image.Image, box: tuple[int, int, int, int], size: tuple[int, int], resample: str) -> Image.Image:
    """Crop first, then resize: Pillow's ``resize(box=...)`` may sample pixels outside the box,
    which would break the "source cropped to box then resized" contract."""
    from PIL import Image

    left, top, crop_width, crop_height = box
    cropped = image.crop((left, top, left + crop_width, top + crop_height))
    if cropped.size == size:
        return cropped
    filters = {"bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}
    return cropped.resize(size, resample=filters[resample])


def size_for_aspect(target_area: int, multiple: int, aspect: float) -> tuple[int, int]:
    """(width, height) of about ``target_area`` pixels at ``aspect``, each side a multiple of ``multiple``."""
    width = max(multiple, round(math.sqrt(target_area * aspect) / multiple) * multiple)
    height = max(multiple, round(math.sqrt(target_area / aspect) / multiple) * multiple)
    return width, height
