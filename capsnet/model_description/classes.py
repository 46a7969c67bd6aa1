"""What a model's outputs say about its classes: which are present, and where KServe clients find their names."""

from __future__ import annotations

import json

# A class is present when its probability (capsule length, or a baseline's sigmoid) is above this: each class's score
# says on its own whether it is in the image, so several can be present at once. Serving's default, and the
# threshold of the pairs test (training/pairs.py).
PRESENT_THRESHOLD = 0.5
# Where Triton's model config carries the class names (its `parameters`, free-form strings): a client such as the
# page at / names the classes from it, since KServe v2 metadata has no place for them.
CLASS_NAMES_PARAMETER = "class_names"


def class_names_parameters(class_names: tuple[str, ...] | list[str]) -> dict[str, dict[str, str]]:
    """Triton model config `parameters` naming the classes: a JSON list, index for index with the probabilities."""
    return {CLASS_NAMES_PARAMETER: {"string_value": json.dumps(list(class_names), ensure_ascii=False)}}
