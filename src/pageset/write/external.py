"""Sources in other formats for ``write_dataset``: WebDataset tar shards and Parquet files.

A Hugging Face ``datasets.Dataset`` needs no adapter (it has ``__len__`` and ``__getitem__`` returning a dict
of columns: name the fields after its columns); an ``IterableDataset`` or any other iterable is read once by
``write_dataset`` (see ``sources.open_source``).

Both sources read through fsspec, so paths may be local or URLs (``s3://``, ``gs://``, ``https://``...), and
use the format's own library for parsing (webdataset for tar members and their key grouping, pyarrow for
Parquet). Both are imported only when a source is constructed.
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Mapping

from ..format import arguments as check
from .sources import SampleError

# Extensions decoded with webdataset's own basic decoders (text, integer classes, JSON, numpy); everything else,
# images included, is handed to the field as the member's bytes. Pickle-like formats are never decoded.
_DECODED_EXTENSIONS = {"txt", "text", "cls", "cls2", "class", "count", "index", "inx", "id", "json", "jsn", "npy"}


def _expand(urls, name: str = "urls") -> list[str]:
    """Brace-expand (``shard-{000..009}.tar``) and glob (local paths, or fsspec URLs) ``urls``, keeping order.
    TypeError (naming the argument ``name``) unless ``urls`` is a path/URL or a list or tuple of them."""
    import braceexpand
    import fsspec

    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]
    if not isinstance(urls, (list, tuple)) or not all(isinstance(u, (str, os.PathLike)) for u in urls):
        raise TypeError(f"{name} must be a path or URL (str or os.PathLike), a brace or glob pattern, or a list of "
                        f"them, got {urls!r}")
    out: list[str] = []
    for u in urls:
        for one in braceexpand.braceexpand(os.fspath(u)):
            if glob.has_magic(one):
                if "://" in one:
                    fs, _, paths = fsspec.get_fs_token_paths(one)
                    found = [fs.unstrip_protocol(p) for p in sorted(paths)]
                else:
                    found = sorted(glob.glob(one))
                if not found:
                    raise ValueError(f"{one}: no file matches this pattern")
                out += found
            else:
                out.append(one)
    if not out:
        raise ValueError("no shard given: pass a path, a URL, a brace or glob pattern, or a list of them")
    return out


class WebDatasetSource:
    """Samples of WebDataset tar shards: ``WebDatasetSource(urls, fields={"image": "jpg", "label": "cls"})``.

    Args:
        urls: a path or URL, a brace pattern (``"shards/train-{0000..0099}.tar"``), a glob, or a list of
            them; shards are read in that order (glob matches sorted), local or through fsspec.
        fields: ``{field name: member extension}``. Members are grouped into samples by key with webdataset;
            extensions txt, cls (and webdataset's other integer keys), json and npy are decoded with
            webdataset's decoders, any other (jpg, png, bin...) is given to the field as bytes.

    The shards are read once, at construction, keeping only the selected members' bytes in memory; for data
    larger than memory write groups of shards to several files and read them together with
    ``pageset.Mixture``. A sample missing one of the extensions raises SampleError naming the shard and the
    member key when written (``on_error="skip"`` leaves it out and records it in the file's lineage).
    ValueError if a pattern matches nothing; the webdataset package is needed (``pip install webdataset``).
    """

    def __init__(self, urls, fields: Mapping[str, str]):
        import fsspec
        from webdataset.autodecode import basichandlers
        from webdataset.tariterators import group_by_keys, tar_file_iterator

        if not isinstance(fields, Mapping) or not fields:
            raise ValueError(f"fields must map field names to member extensions, e.g. {{'image': 'jpg', "
                             f"'label': 'cls'}}, got {fields!r}")
        self.fields = {str(k): str(v).lstrip(".") for k, v in fields.items()}
        self.urls = _expand(urls)
        self.samples: list[tuple[str, str, dict, list]] = []  # (url, key, {field: value}, member extensions)
        for url in self.urls:
            with fsspec.open(url, "rb") as f:
                members = ({**m, "__url__": url} for m in tar_file_iterator(f))
                for sample in group_by_keys(members):
                    exts = sorted(k for k in sample if not k.startswith("__"))
                    values = {}
                    for name, ext in self.fields.items():
                        if ext in sample:
                            data = sample[ext]
                            decoded = basichandlers(ext, data) if ext.lower() in _DECODED_EXTENSIONS else None
                            values[name] = data if decoded is None else decoded
                    self.samples.append((url, sample["__key__"], values, exts))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        url, key, values, exts = self.samples[i]
        for name, ext in self.fields.items():
            if name not in values:
                raise SampleError(f"WebDataset shard {url}", i, name,
                                  f"member {key!r} has no {ext!r} file (it has {exts})")
        return dict(values)

    def __repr__(self) -> str:
        return f"WebDatasetSource({len(self.urls)} shards, {len(self)} samples, fields={self.fields})"


class ParquetSource:
    """Rows of Parquet files: ``ParquetSource("train.parquet", columns={"image": "img", "label": "label"})``.

    Args:
        paths: a path or URL (fsspec), a glob, or a list of them; rows are read in that order.
        columns: ``{field name: column name}`` (default: every column under its own name). An image column
            may hold encoded bytes, paths, or Hugging Face's image struct ``{"bytes", "path"}`` (bytes win).

    Rows are read one row group at a time (the group of the last row asked for is kept), so memory is one row
    group per process. ValueError naming the file for a missing column; needs pyarrow.
    """

    def __init__(self, paths, columns: Mapping[str, str] | None = None):
        import fsspec
        import pyarrow.parquet as pq

        columns = check.mapping("columns", columns, optional=True, example="{'image': 'img', 'label': 'label'}")
        self.paths = _expand(paths, "paths")
        self._groups, self._starts = [], [0]
        for path in self.paths:
            with fsspec.open(path, "rb") as f:
                pf = pq.ParquetFile(f)
                meta, names = pf.metadata, pf.schema_arrow.names
            if columns is None:
                columns = {n: n for n in names}
            for name, col in columns.items():
                if col not in names:
                    raise ValueError(f"{path}: no column {col!r} for field {name!r}; the file has {names}")
            for g in range(meta.num_row_groups):
                self._groups.append((path, g))
                self._starts.append(self._starts[-1] + meta.row_group(g).num_rows)
        self.columns = dict(columns or {})
        self._cached: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return self._starts[-1]

    def _group(self, g: int) -> dict:
        if self._cached is None or self._cached[0] != g:
            import fsspec
            import pyarrow.parquet as pq

            path, rg = self._groups[g]
            with fsspec.open(path, "rb") as f:
                table = pq.ParquetFile(f).read_row_group(rg, columns=sorted(set(self.columns.values())))
            self._cached = (g, {c: table.column(c).to_pylist() for c in table.column_names})
        return self._cached[1]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} is outside [0, {len(self)})")
        g = bisect.bisect_right(self._starts, i) - 1
        cols = self._group(g)
        row = i - self._starts[g]
        out = {}
        for name, col in self.columns.items():
            value = cols[col][row]
            if isinstance(value, dict) and set(value) >= {"bytes", "path"}:  # HF image struct
                value = value["bytes"] if value["bytes"] is not None else value["path"]
            out[name] = value
        return out

    def __repr__(self) -> str:
        return f"ParquetSource({len(self.paths)} files, {len(self)} rows, columns={self.columns})"
