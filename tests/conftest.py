"""Shared fixtures: real photos from the test extra's wheels and small real datasets built from them."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pageset.sample_data import make_imagenet_like, wheel_photos


@pytest.fixture(scope="session")
def photos() -> list[str]:
    paths = wheel_photos()
    assert len(paths) >= 6, "the test extra (scikit-image, scikit-learn) must be installed"
    return paths


@pytest.fixture(scope="session")
def photo_arrays(photos) -> list[np.ndarray]:
    """RGB uint8 arrays of the real photos (grayscale ones converted)."""
    out = []
    for p in photos:
        with Image.open(p) as img:
            out.append(np.asarray(img.convert("RGB")))
    return out


@pytest.fixture(scope="session")
def imagenet_like(tmp_path_factory, photos):
    """An ImageFolder of 48 JPEG crops (long side 160-220 px) of the real photos; classes = source photo."""
    root = tmp_path_factory.mktemp("inet") / "train"
    return make_imagenet_like(root, 48, long_side=(160, 220), photos=photos, seed=1)
