"""Sources the writer accepts, normalised to ``len()`` and ``sample(i) -> {field name: value}``.

- any indexable object: ``__len__`` and ``__getitem__`` returning a tuple (values in field order) or a dict;
- an ImageFolder-style directory: one sub-folder per class, sorted by name, integer labels 0..C-1;
- a list of image paths.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..format.fields import Field, Int, RGBImage

# torchvision's ImageFolder extensions (lower case); other files in class folders are ignored, as there.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class SampleError(ValueError):
    """Encoding one sample failed. Attributes: ``index`` (int), ``field`` (str or None), ``source`` (str)."""

    def __init__(self, source: str, index: int, field: str | None, detail: str):
        self.source, self.index, self.field, self.detail = source, index, field, detail
        where = f"sample {index}" + (f", field {field!r}" if field else "")
        super().__init__(f"{source}: {where}: {detail}")

    def __reduce__(self):
        return (SampleError, (self.source, self.index, self.field, self.detail))


@dataclass
class ImageFolder:
    """An ImageFolder-style directory: ``root/<class>/<image>``; samples are ``(path, label)``.

    Classes are the sub-folder names in sorted order; files inside each are sorted by name; files whose
    extension is not in ``IMAGE_EXTENSIONS`` are skipped (as torchvision does) and counted in ``ignored``.
    Raises ``ValueError`` when ``root`` holds no class folder or no image.
    """

    root: str
    classes: list[str] = field(default_factory=list)
    samples: list[tuple[str, int]] = field(default_factory=list)
    ignored: int = 0

    def __post_init__(self):
        root = Path(self.root)
        if not root.is_dir():
            raise ValueError(f"{self.root}: not a directory; ImageFolder needs root/<class>/<image> folders")
        # Hidden folders (.ipynb_checkpoints, .git) are not classes, as in torchvision.
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not self.classes:
            raise ValueError(f"{self.root}: no class sub-folders; expected root/<class>/<image>")
        for label, name in enumerate(self.classes):
            found = 0
            for p in sorted((root / name).rglob("*")):
                if not p.is_file() or any(part.startswith(".") for part in p.relative_to(root).parts):
                    self.ignored += not p.is_dir()  # hidden files, broken links
                    continue
                if p.suffix.lower() in IMAGE_EXTENSIONS:
                    self.samples.append((str(p), label))
                    found += 1
                else:
                    self.ignored += 1
            if not found:
                raise ValueError(f"{self.root}: class folder {name!r} holds no image (extensions {IMAGE_EXTENSIONS}); "
                                 "an empty class would shift every later label: remove the folder or add images")
        if not self.samples:
            raise ValueError(f"{self.root}: no image files (extensions {IMAGE_EXTENSIONS}) under the class folders")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.samples[i]


@dataclass
class Source:
    """A normalised source: ``len(src)``, ``src.sample(i) -> dict``, a description and dataset attributes."""

    data: object
    names: list[str]
    description: str
    attributes: dict
    base: int = 0  # index of data[0] in the whole source (a part holds a slice of a list-backed source)

    def __len__(self) -> int:
        return len(self.data)

    def part(self, start: int, stop: int) -> Source:
        """The source as a task for samples ``[start, stop)`` needs it: a slice of a list of paths or of an
        ImageFolder's samples (small to send to a worker), otherwise the whole source."""
        if self.base == 0 and isinstance(self.data, (list, ImageFolder)):
            items = self.data[start:stop] if isinstance(self.data, list) else self.data.samples[start:stop]
            return Source(items, self.names, self.description, {}, start)
        return self

    def sample(self, i: int) -> dict:
        """Sample ``i`` as ``{field name: value}``; raises SampleError on a wrong shape of sample."""
        item = self.data[i - self.base]
        if isinstance(item, Mapping):
            missing = [n for n in self.names if n not in item]
            if missing:
                raise SampleError(
                    self.description, i, missing[0],
                    f"the sample dict has no key {missing[0]!r} (keys: {sorted(map(str, item))}); "
                    "every sample must provide every field",
                )
            return {n: item[n] for n in self.names}
        if isinstance(item, (str, os.PathLike, bytes)) and len(self.names) == 1:
            return {self.names[0]: item}
        if not isinstance(item, (tuple, list)):
            item = (item,)
        if len(item) != len(self.names):
            raise SampleError(
                self.description, i, None,
                f"the sample has {len(item)} values but there are {len(self.names)} fields {self.names}; "
                "return one value per field, in field order, or a dict",
            )
        return dict(zip(self.names, item))


def open_source(source, fields: Mapping[str, Field] | None) -> tuple[Source, dict[str, Field]]:
    """Normalise ``source`` and pick default fields when ``fields`` is None.

    Defaults: an ImageFolder gives ``{"image": RGBImage(), "label": Int()}``; a list of paths gives
    ``{"image": RGBImage()}``. Other sources need explicit fields (TypeError otherwise).
    """
    attributes: dict = {}
    if isinstance(source, (str, os.PathLike)):
        folder = ImageFolder(os.fspath(source))
        attributes = {"class_names": folder.classes, "ignored_files": folder.ignored}
        default = {"image": RGBImage(), "label": Int()}
        data, description = folder, f"ImageFolder {os.fspath(source)!r}"
    elif isinstance(source, Sequence) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
        default = {"image": RGBImage()}
        data, description = [os.fspath(p) for p in source], f"list of {len(source)} image paths"
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        default = None
        data, description = source, f"source {type(source).__name__}"
    else:
        raise TypeError(
            f"cannot read samples from {type(source).__name__}: give an ImageFolder directory, a list of image "
            "paths, or an object with __len__ and __getitem__"
        )
    if fields is None:
        if default is None:
            raise TypeError(f"{description}: pass fields=, e.g. {{'image': RGBImage(), 'label': Int()}}")
        fields = default
    fields = dict(fields)
    return Source(data, list(fields), description, attributes), fields
