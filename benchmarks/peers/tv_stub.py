"""A stand-in for the two torchvision names `import streaming` touches, when torchvision is absent.

mosaicml-streaming imports ``torchvision.datasets.VisionDataset`` and ``torchvision.transforms.functional.to_tensor``
at import time (for its ready-made vision datasets, unused by the benchmark); PyPI's torchvision wheels are
CUDA builds that do not load beside the CPU torch. ``import_streaming()`` registers minimal modules only while
``streaming`` is imported, and only when the real torchvision is absent, then removes them again (so that
litdata's and lightning-utilities' ``find_spec("torchvision")`` checks still see no torchvision).
"""

import importlib.machinery
import importlib.util
import sys
import types


def import_streaming():
    """``import streaming`` with the stand-in torchvision in place (when needed); returns the module."""
    if importlib.util.find_spec("torchvision") is not None:
        import streaming

        return streaming
    names = install()
    try:
        import streaming

        return streaming
    finally:
        for name in names:
            sys.modules.pop(name, None)


def install() -> list:
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class VisionDataset:  # only subclassed by streaming.vision.base
        def __init__(self, *args, **kwargs):
            raise RuntimeError("torchvision is not installed (stub)")

    def to_tensor(*args, **kwargs):
        raise RuntimeError("torchvision is not installed (stub)")

    datasets.VisionDataset = VisionDataset
    functional.to_tensor = to_tensor
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    tv.__version__ = "0.0.0-stub"
    mods = {"torchvision": tv, "torchvision.datasets": datasets, "torchvision.transforms": transforms,
            "torchvision.transforms.functional": functional}
    for name, mod in mods.items():
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules.update(mods)
    return list(mods)
