"""Sources the writer accepts, normalised to ``len()`` and ``sample(i) -> {field name: value}``.

- any indexable object: ``__len__`` and ``__getitem__`` returning a tuple (values in field order) or a dict;
- an ImageFolder-style directory: one sub-folder per class, sorted by name, integer labels 0..C-1;
- a list of image paths;
- a file list (:class:`ImageList`): a text file of image paths, one per line, optionally ``<path>\t<label>``;
- any other iterable (a generator, a Hugging Face ``datasets.IterableDataset``): read once into a list.

A Hugging Face ``datasets.Dataset`` is an indexable object returning dicts; WebDataset shards and Parquet files
have adapters in ``external.py``.
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
    """Encoding one sample failed. Attributes: ``index`` (int), ``field`` (str or None), ``source`` (str: the
    source's description, e.g. the folder or file list it came from), ``detail`` (the cause), ``hint`` (what to
    do about it, or ``""``), ``brief`` (the message without the hint). When a worker process failed, its
    traceback is the ``__cause__`` (a :class:`WorkerTraceback`)."""

    def __init__(self, source: str, index: int, field: str | None, detail: str, hint: str = ""):
        self.source, self.index, self.field, self.detail, self.hint = source, index, field, detail, hint
        where = f"sample {index}" + (f", field {field!r}" if field else "")
        self.brief = f"{source}: {where}: {detail}"
        super().__init__(self.brief + (f"\n{hint}" if hint else ""))

    def __reduce__(self):
        return (SampleError, (self.source, self.index, self.field, self.detail, self.hint))


class WorkerTraceback(Exception):
    """The formatted traceback of an exception raised in a writer worker process (set as ``__cause__`` of the
    error raised in the caller, as ``concurrent.futures`` does, so it is shown once, below the message)."""

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.args[0]}\"\"\""


@dataclass
class ImageFolder:
    """An ImageFolder-style directory: ``root/<class>/<image>``; samples are ``(path, label)``.

    Classes are the sub-folder names in sorted order; files inside each are sorted by name; files whose
    extension is not in ``IMAGE_EXTENSIONS`` are skipped (as torchvision does) and counted in ``ignored``.
    Raises ``ValueError`` when ``root`` holds no class folder or no image.
    """

    root: str
    classes: list[str] = field(default_factory=list, init=False)
    samples: list[tuple[str, int]] = field(default_factory=list, init=False)
    ignored: int = field(default=0, init=False)

    def __post_init__(self):
        if isinstance(self.root, bytes) or not isinstance(self.root, (str, os.PathLike)):
            raise TypeError(f"ImageFolder.root must be a folder path (str or os.PathLike), got {self.root!r}")
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
class ImageList:
    """A file list: a UTF-8 text file with one image path per line, optionally ``<path>\t<label>`` (an int);
    blank lines and lines starting with ``#`` are skipped. Relative paths are relative to the list file's folder
    (not to the current folder), so a list moves with its images. Either every line has a label or none does.

    Samples are ``(path,)`` or ``(path, label)``; ``labelled`` says which. Raises ``FileNotFoundError`` (no such
    list) or ``ValueError`` naming the list file and line.
    """

    path: str
    rows: list = field(default_factory=list, init=False)
    labelled: bool = field(default=False, init=False)

    def __post_init__(self):
        if isinstance(self.path, bytes) or not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"ImageList.path must be the file list's path (str or os.PathLike), got {self.path!r}")
        self.path = os.fspath(self.path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"file list {self.path}: no such file")
        base = os.path.dirname(os.path.abspath(self.path))
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except UnicodeDecodeError as exc:
            raise ValueError(f"file list {self.path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) > 2:
                raise ValueError(f"{self.path}:{lineno}: expected '<path>' or '<path>\\t<label>', got {line!r}")
            p = parts[0] if os.path.isabs(parts[0]) else os.path.join(base, parts[0])
            try:
                self.rows.append((p, int(parts[1])) if len(parts) == 2 else (p,))
            except ValueError:
                raise ValueError(f"{self.path}:{lineno}: label {parts[1]!r} is not an integer") from None
        if not self.rows:
            raise ValueError(f"file list {self.path}: no image paths listed")
        if len({len(r) for r in self.rows}) != 1:
            raise ValueError(f"file list {self.path}: either every line has a label or none does")
        self.labelled = len(self.rows[0]) == 2

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]


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
        ImageFolder's samples or a file list's rows (small to send to a worker), otherwise the whole source."""
        if self.base == 0 and isinstance(self.data, (list, ImageFolder, ImageList)):
            items = (self.data[start:stop] if isinstance(self.data, list) else
                     self.data.samples[start:stop] if isinstance(self.data, ImageFolder) else self.data.rows[start:stop])
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
    ``{"image": RGBImage()}``; a file list (a path to a text file, or an :class:`ImageList`) either, depending on
    its labels. Other sources need explicit fields (TypeError otherwise).
    """
    attributes: dict = {}
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        if os.fspath(source).lower().endswith(IMAGE_EXTENSIONS):
            raise ValueError(f"{os.fspath(source)} is one image: give a list of image paths ([path]), an ImageFolder "
                             "directory or a file list (a text file of image paths)")
        source = ImageList(source)
    if isinstance(source, ImageList):
        default = {"image": RGBImage(), "label": Int()} if source.labelled else {"image": RGBImage()}
        data, description = source, f"file list {source.path!r}"
    elif isinstance(source, (str, os.PathLike, ImageFolder)):
        # an ImageFolder object keeps its class list too (it was once written as a plain indexable source)
        folder = source if isinstance(source, ImageFolder) else ImageFolder(os.fspath(source))
        attributes = {"class_names": folder.classes, "ignored_files": folder.ignored}
        default = {"image": RGBImage(), "label": Int()}
        data, description = folder, f"ImageFolder {os.fspath(folder.root)!r}"
    elif isinstance(source, Sequence) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
        default = {"image": RGBImage()}
        data, description = [os.fspath(p) for p in source], f"list of {len(source)} image paths"
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        default = None
        data, description = source, f"source {type(source).__name__}"
    elif hasattr(source, "__iter__") and not isinstance(source, (str, bytes, Mapping)):
        default = None
        data = list(source)  # a stream (generator, datasets.IterableDataset): its samples, in order
        description = f"iterable {type(source).__name__}"
    else:
        raise TypeError(
            f"cannot read samples from {type(source).__name__}: give an ImageFolder directory, a list of image "
            "paths, an object with __len__ and __getitem__, or an iterable of samples"
        )
    if fields is None:
        if default is None:
            raise TypeError(f"{description}: pass fields=, e.g. {{'image': RGBImage(), 'label': Int()}}")
        fields = default
    fields = dict(fields)
    return Source(data, list(fields), description, attributes), fields
