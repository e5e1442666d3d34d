"""pageset: page-aligned dataset files and a loader that keeps accelerators fed.

Public API::

    from pageset import write_dataset, open_dataset, RGBImage, Int
    write_dataset("train.pageset", "imagenet/train", {"image": RGBImage(max_resolution=512), "label": Int()})
    ds = open_dataset("train.pageset")

    from pageset import Loader, RandomResizedCrop, RandomHorizontalFlip, Normalize, ToTensor, ToDevice
    loader = Loader("train.pageset", batch_size=256, pipelines={"image": [RandomResizedCrop(224), ...]})

The loader names (``Loader``, the ops, ``ToDevice``) import torch and numba, and the writers Pillow and the
encoders, so both load on first use: ``import pageset`` alone stays light (format and reader only).
"""

from .format import (
    JSON,
    BadMagicError,
    Bytes,
    ChecksumMismatchError,
    FileChangedError,
    Float,
    FormatError,
    IndexBoundsError,
    Int,
    NDArray,
    ObjectChangedError,
    RemoteReadError,
    RGBImage,
    SchemaError,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from .format.fields import RGBImages, TokenIds, Tokens
from .read import Dataset, EncodedImage, open_dataset, open_tokens
from .read.tokens import TokenDataset

# Loaded on first use: the writers (Pillow, the encoders; ~0.2 s a Loader-only process never needs) and the
# loader names (torch, numba).
_LAZY = {
    "ImageFolder": "pageset.write",
    "ImageList": "pageset.write",
    "ParquetSource": "pageset.write",
    "SampleError": "pageset.write",
    "WebDatasetSource": "pageset.write",
    "WriteResult": "pageset.write",
    "write_dataset": "pageset.write",
    "import_llmc": "pageset.write.importers",
    "import_megatron": "pageset.write.importers",
    "import_nanogpt": "pageset.write.importers",
    "TokenWriteResult": "pageset.write.tokens",
    "write_tokens": "pageset.write.tokens",
    "merge_datasets": "pageset.merge",
    "gather_windows": "pageset.ops.tokens",
    "document_outputs": "pageset.ops.tokens",
    "Loader": "pageset.load",
    "PageOptions": "pageset.load.options",
    "RemoteOptions": "pageset.load.options",
    "Mixture": "pageset.order.mixture",
    "Schedule": "pageset.order.schedule",
    "DecodeError": "pageset.load",
    "PipelineError": "pageset.load",
    "StateError": "pageset.order.state",
    "StateMismatchError": "pageset.order.state",
    "ToDevice": "pageset.device",
    "RandomResizedCrop": "pageset.ops.transforms",
    "CenterCrop": "pageset.ops.transforms",
    "SmartResize": "pageset.ops.transforms",
    "RandomHorizontalFlip": "pageset.ops.transforms",
    "Normalize": "pageset.ops.transforms",
    "ToTensor": "pageset.ops.transforms",
    "ToTorchImage": "pageset.ops.transforms",
    "TokenWindows": "pageset.ops.transforms",
    "PadTokens": "pageset.ops.transforms",
    "ExpandImageTokens": "pageset.ops.transforms",
    "ChatTokenizer": "pageset.write.chat",
    "LlavaSource": "pageset.write.llava",
    "IntDecoder": "pageset.ops.transforms",
    "FloatDecoder": "pageset.ops.transforms",
    "NDArrayDecoder": "pageset.ops.transforms",
    "BytesDecoder": "pageset.ops.transforms",
    "JSONDecoder": "pageset.ops.transforms",
    "IMAGENET_MEAN": "pageset.ops.transforms",
    "IMAGENET_STD": "pageset.ops.transforms",
    "RayExecutor": "pageset.write.ray_executor",
    "PagesetDatasink": "pageset.write.ray_datasink",
}


def __getattr__(name):
    if name == "__version__":  # the installed distribution's version (pyproject.toml), read when asked
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pageset")
        except PackageNotFoundError:  # a source tree on sys.path, never installed
            return "0+unknown"
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pageset' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BadMagicError",
    "Bytes",
    "BytesDecoder",
    "CenterCrop",
    "ChecksumMismatchError",
    "Dataset",
    "DecodeError",
    "EncodedImage",
    "FileChangedError",
    "Float",
    "FloatDecoder",
    "FormatError",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageFolder",
    "ImageList",
    "IndexBoundsError",
    "Int",
    "IntDecoder",
    "JSON",
    "JSONDecoder",
    "LlavaSource",
    "Loader",
    "Mixture",
    "NDArray",
    "NDArrayDecoder",
    "Normalize",
    "ObjectChangedError",
    "ParquetSource",
    "PipelineError",
    "PadTokens",
    "PageOptions",
    "PagesetDatasink",
    "RGBImage",
    "RayExecutor",
    "RemoteOptions",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "SmartResize",
    "RemoteReadError",
    "Schedule",
    "SampleError",
    "SchemaError",
    "StateError",
    "StateMismatchError",
    "ToDevice",
    "ToTensor",
    "ToTorchImage",
    "TokenDataset",
    "TokenIds",
    "RGBImages",
    "ChatTokenizer",
    "ExpandImageTokens",
    "TokenWindows",
    "TokenWriteResult",
    "Tokens",
    "TruncatedFileError",
    "UnsupportedFeatureError",
    "UnsupportedVersionError",
    "WebDatasetSource",
    "WriteResult",
    "document_outputs",
    "gather_windows",
    "import_llmc",
    "import_megatron",
    "import_nanogpt",
    "merge_datasets",
    "open_dataset",
    "open_tokens",
    "write_dataset",
    "write_tokens",
]
