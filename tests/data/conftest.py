import numpy as np
import pytest
from PIL import Image


def write_jpegs(root, classes=2, per_class=16, size=64, seed=0):
    """An ImageFolder tree of random-noise JPEGs (noise decodes slowest: no flat areas)."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i:04d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    return write_jpegs(tmp_path_factory.mktemp("images") / "train")
