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
import re
import threading
from collections.abc import Mapping

from ..format import arguments as check
from .sources import SampleError

# Extensions decoded with webdataset's own basic decoders (text, integer classes, JSON, numpy); everything else,
# images included, is handed to the field as the member's bytes. Pickle-like formats are never decoded.
_DECODED_EXTENSIONS = {"txt", "text", "cls", "cls2", "class", "count", "index", "inx", "id", "json", "jsn", "npy"}


def _expand(urls, name: str = "urls", storage_options: dict | None = None,
            origins: dict | None = None) -> list[str]:
    """Brace-expand (``shard-{000..009}.tar``) and glob (local paths, or fsspec URLs) ``urls``, keeping order.
    TypeError (naming the argument ``name``) unless ``urls`` is a path/URL or a list or tuple of them; ValueError
    for a glob matching nothing. ``origins``, when given, receives ``{expanded url: brace pattern}`` for the
    URLs that came from a brace pattern (to name the pattern when its shards are missing)."""
    import braceexpand
    import fsspec

    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]
    if not isinstance(urls, (list, tuple)) or not all(isinstance(u, (str, os.PathLike)) for u in urls):
        raise TypeError(f"{name} must be a path or URL (str or os.PathLike), a brace or glob pattern, or a list of "
                        f"them, got {urls!r}")
    out: list[str] = []
    for u in urls:
        expanded = list(braceexpand.braceexpand(os.fspath(u)))
        for one in expanded:
            if glob.has_magic(one):
                if "://" in one:
                    fs, _, paths = fsspec.get_fs_token_paths(one, storage_options=storage_options or None)
                    found = [fs.unstrip_protocol(p) for p in sorted(paths)]
                else:
                    found = sorted(glob.glob(one))
                if not found:
                    raise ValueError(f"{one}: no file matches this pattern")
                out += found
            else:
                if origins is not None and len(expanded) > 1:
                    origins[one] = os.fspath(u)
                out.append(one)
    if not out:
        raise ValueError("no shard given: pass a path, a URL, a brace or glob pattern, or a list of them")
    return out


def _missing_shard(url: str, origins: dict, storage_options: dict) -> Exception:
    """The error for a shard that does not exist: naming the brace pattern when it came from one."""
    pattern = origins.get(url)
    if pattern is None:
        return FileNotFoundError(f"WebDataset shard {url}: no such file; check the path")
    import fsspec

    names = [u for u, p in origins.items() if p == pattern]
    fs, _, _ = fsspec.get_fs_token_paths(url, storage_options=storage_options or None)
    missing = [u for u in names if not fs.exists(u)]
    if len(missing) == len(names):
        return ValueError(f"{pattern}: no shard matches this brace pattern (none of its {len(names)} names exists, "
                          f"e.g. {names[0]}); check the folder and the numbering")
    return FileNotFoundError(f"WebDataset shard {url}: no such file; {len(missing)} of the {len(names)} shards of "
                             f"{pattern} are missing (first: {missing[:3]})")


def _open_shard(url: str, storage_options: dict | None):
    """(fsspec file, readable and seekable stream of the tar bytes): the file itself for a plain tar, a
    decompressing view (gzip, bz2, xz: seekable by decompressing) for a compressed one."""
    import fsspec

    f = fsspec.open(url, "rb", **(storage_options or {})).open()
    try:
        magic = f.read(6)
        f.seek(0)
        if magic[:2] == b"\x1f\x8b":
            import gzip
            return f, gzip.GzipFile(fileobj=f, mode="rb")
        if magic[:3] == b"BZh":
            import bz2
            return f, bz2.BZ2File(f, "rb")
        if magic == b"\xfd7zXZ\x00":
            import lzma
            return f, lzma.LZMAFile(f, "rb")
        return f, f
    except BaseException:
        f.close()
        raise


def _shard_error(url: str, what: str) -> ValueError:
    return ValueError(f"WebDataset shard {url}: {what}; re-create or re-download this shard, or leave it out of "
                      "urls")


def _index_shard(url: str, storage_options: dict | None) -> list[tuple[str, dict, list]]:
    """The samples of one tar shard, from its headers only: ``[(key, {extension: (offset, size)}, extensions)]``,
    grouped with webdataset's rules (key = name up to the first dot of the base name, extensions lower case,
    ``__meta__`` files and non-regular members skipped). ValueError naming the shard for a broken tar."""
    import tarfile

    from webdataset.tariterators import group_by_keys, meta_prefix, meta_suffix

    raw, stream = _open_shard(url, storage_options)
    members = []
    try:
        with raw, stream:
            try:
                with tarfile.open(fileobj=stream, mode="r:") as tf:
                    for info in tf:  # reads each header and seeks over the member's data
                        name = info.name
                        if not info.isreg() or ("/" not in name and name.startswith(meta_prefix)
                                                and name.endswith(meta_suffix)) or re.match(r"__[^/]*__($|/)", name):
                            continue
                        members.append({"fname": name, "data": (info.offset_data, info.size), "__url__": url})
                    end = tf.offset  # just past the last member's (512-byte padded) data
                stream.seek(end)
                tail = stream.read(512)
            except (tarfile.TarError, EOFError, OSError, zlib_error()) as exc:
                raise _shard_error(url, f"not a readable tar file ({type(exc).__name__}: {exc})") from None
            if members:
                last_end = members[-1]["data"][0] + members[-1]["data"][1]
                size = getattr(raw, "size", None) if stream is raw else None
                if size is not None and last_end > size:
                    raise _shard_error(url, f"truncated: member {members[-1]['fname']!r} ends at byte {last_end} "
                                            f"but the file has {size} bytes")
            if tail.strip(b"\x00"):
                raise _shard_error(url, f"invalid tar header at byte {end} (after {len(members)} members): the "
                                        "file is corrupt from there on")
    except ValueError:
        raise
    samples = []
    try:
        for s in group_by_keys(iter(members)):
            exts = sorted(k for k in s if not k.startswith("__"))
            samples.append((s["__key__"], {k: s[k] for k in exts}, exts))
    except ValueError as exc:  # a member name repeated within one sample
        raise _shard_error(url, str(exc)) from None
    return samples


def zlib_error():
    import zlib

    return zlib.error


class WebDatasetSource:
    """Samples of WebDataset tar shards: ``WebDatasetSource(urls, fields={"image": "jpg", "label": "cls"})``.

    Args:
        urls: a path or URL, a brace pattern (``"shards/train-{0000..0099}.tar"``), a glob, or a list of
            them; shards are read in that order (glob matches sorted), local or through fsspec. Plain tars are
            best; gzip, bz2 and xz compressed tars are read by decompressing.
        fields: ``{field name: member extension}``. Members are grouped into samples by key with webdataset;
            extensions txt, cls (and webdataset's other integer keys), json and npy are decoded with
            webdataset's decoders, any other (jpg, png, bin...) is given to the field as bytes.
        storage_options: options for fsspec's filesystem of the URLs (e.g. ``{"anon": True}`` or an
            endpoint for ``s3://``).

    Construction reads only the tar headers (sample keys and the byte offset and size of each selected member;
    the payloads are skipped) and keeps that index, so the source stays small when sent to writer processes;
    a sample's members are read (one ranged read each) when it is asked for. Errors: ValueError naming the
    shard for a tar whose structure is broken (corrupt or truncated) or a pattern matching no shard;
    FileNotFoundError naming a missing shard; when a sample is read, SampleError naming the shard, the sample
    index, the member key and the field for a missing member or a value webdataset cannot decode (e.g. a
    ``.cls`` that is not an integer): ``write_dataset(..., on_error="skip")`` leaves such samples out. The
    webdataset package is needed (``pip install webdataset``).
    """

    def __init__(self, urls, fields: Mapping[str, str], storage_options: Mapping | None = None):
        import numpy as np

        if not isinstance(fields, Mapping) or not fields:
            raise ValueError(f"fields must map field names to member extensions, e.g. {{'image': 'jpg', "
                             f"'label': 'cls'}}, got {fields!r}")
        self.storage_options = dict(check.mapping("storage_options", storage_options, optional=True,
                                                  example="{'anon': True}") or {})
        self.fields = {str(k): str(v).lstrip(".") for k, v in fields.items()}
        origins: dict = {}
        self.urls = _expand(urls, storage_options=self.storage_options, origins=origins)
        exts = list(self.fields.values())
        shard_of, keys, spans, present = [], [], [], {}
        for s, url in enumerate(self.urls):
            try:
                samples = _index_shard(url, self.storage_options)
            except FileNotFoundError:
                raise _missing_shard(url, origins, self.storage_options) from None
            for key, members, member_exts in samples:
                if not all(e in members for e in exts):
                    present[len(keys)] = member_exts  # kept only for the error message of an incomplete sample
                shard_of.append(s)
                keys.append(key)
                spans.append([members.get(e, (-1, -1)) for e in exts])
        # The index: per sample its shard, key, and (offset, size) of each field's member ((-1, -1): missing).
        self._shard = np.asarray(shard_of, dtype=np.int32)
        self._keys = keys
        self._spans = np.asarray(spans, dtype=np.int64).reshape(len(keys), len(exts), 2)
        self._present = present
        self._open: tuple | None = None  # (shard number, fsspec file, stream) of this process; not pickled
        self._lock = threading.Lock()  # one open shard per source: reads from several threads take turns

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_open", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _open=None, _lock=threading.Lock())

    def __len__(self) -> int:
        return len(self._keys)

    def _read(self, s: int, offset: int, size: int) -> bytes:
        with self._lock:
            if self._open is None or self._open[0] != s:
                self._close()
                self._open = (s, *_open_shard(self.urls[s], self.storage_options))
            stream = self._open[2]
            stream.seek(offset)
            data = stream.read(size)
        if len(data) != size:
            raise _shard_error(self.urls[s], f"truncated: {size} bytes expected at byte {offset}, {len(data)} read "
                                             "(did the shard change after this source was built?)")
        return data

    def close(self) -> None:
        """Close the shard file this process has open (reopened by the next read)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._open is not None:
            _, raw, stream = self._open
            self._open = None
            stream.close()
            raw.close()

    def __getitem__(self, i: int) -> dict:
        from webdataset.autodecode import basichandlers

        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} is outside [0, {len(self)})")
        i = i % len(self)
        s, key = int(self._shard[i]), self._keys[i]
        url = self.urls[s]
        out = {}
        for j, (name, ext) in enumerate(self.fields.items()):
            offset, size = (int(v) for v in self._spans[i, j])
            if offset < 0:
                raise SampleError(f"WebDataset shard {url}", i, name,
                                  f"member {key!r} has no {ext!r} file (it has {self._present.get(i)}); add the "
                                  "file to the shard or map the field to an extension every member has")
            try:
                data = self._read(s, offset, size)
            except OSError as exc:  # the store failed: name the shard and member (the writer adds the sample)
                raise OSError(f"WebDataset shard {url}: reading member {key}.{ext} ({size} bytes at byte {offset}) "
                              f"failed: {type(exc).__name__}: {exc}") from exc
            if ext.lower() in _DECODED_EXTENSIONS:
                try:
                    decoded = basichandlers(ext, data)
                except Exception as exc:
                    raise SampleError(f"WebDataset shard {url}", i, name,
                                      f"member {key}.{ext} ({size} bytes, starting {data[:20]!r}) cannot be decoded "
                                      f"as {ext!r} by webdataset ({type(exc).__name__}: {exc}); fix that file or "
                                      "map the field to an extension that is not decoded (given as bytes)") from exc
                if decoded is not None:
                    data = decoded
            out[name] = data
        return out

    def __repr__(self) -> str:
        return f"WebDatasetSource({len(self.urls)} shards, {len(self)} samples, fields={self.fields})"


class ParquetSource:
    """Rows of Parquet files: ``ParquetSource("train.parquet", columns={"image": "img", "label": "label"})``.

    Args:
        paths: a path or URL (fsspec), a glob, or a list of them; rows are read in that order.
        columns: ``{field name: column name}`` (default: every column under its own name). An image column
            may hold encoded bytes, paths, or Hugging Face's image struct ``{"bytes", "path"}`` (bytes win).
        storage_options: options for fsspec's filesystem of the URLs (e.g. ``{"anon": True}``).

    Rows are read one row group at a time (the group of the last row asked for is kept), so memory is one row
    group per process. ValueError naming the file for a missing column or a file that is not Parquet;
    FileNotFoundError naming a missing file; needs pyarrow.
    """

    def __init__(self, paths, columns: Mapping[str, str] | None = None, storage_options: Mapping | None = None):
        import fsspec
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = check.mapping("columns", columns, optional=True, example="{'image': 'img', 'label': 'label'}")
        self.storage_options = dict(check.mapping("storage_options", storage_options, optional=True,
                                                  example="{'anon': True}") or {})
        self.paths = _expand(paths, "paths", storage_options=self.storage_options)
        self._groups, self._starts = [], [0]
        for path in self.paths:
            try:
                with fsspec.open(path, "rb", **self.storage_options) as f:
                    pf = pq.ParquetFile(f)
                    meta, names = pf.metadata, pf.schema_arrow.names
            except FileNotFoundError:
                raise FileNotFoundError(f"Parquet file {path}: no such file; check the path") from None
            except (pa.ArrowException, OSError) as exc:
                raise ValueError(f"Parquet file {path}: not a readable Parquet file ({type(exc).__name__}: {exc}); "
                                 "re-create or re-download it, or leave it out of paths") from None
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

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cached": None}  # the row group read last stays in this process

    def __len__(self) -> int:
        return self._starts[-1]

    def _group(self, g: int) -> dict:
        if self._cached is None or self._cached[0] != g:
            import fsspec
            import pyarrow.parquet as pq

            path, rg = self._groups[g]
            with fsspec.open(path, "rb", **self.storage_options) as f:
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
