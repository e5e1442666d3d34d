"""A Ray Data ``Datasink``: ``ds.write_datasink(PagesetDatasink(folder, fields))`` writes a many-file dataset.

Each Ray Data write task turns the rows it is given into one complete member file (``formats/manyfile.md``),
written and renamed (or uploaded) by the task itself; the driver only collects each task's small summary and,
when every task has finished, writes the manifest, last and atomically. Nothing of the data passes through the
driver, as with ``write_dataset(records_per_member=...)``.

Member cuts follow Ray Data's write tasks: member k holds the rows of the write task with ``task_idx`` k, in the
order the task receives them. Ray Data gives the same tasks the same rows for the same input, plan and
parallelism when ``DataContext.execution_options.preserve_order`` is set (pageset's sink asks for nothing else),
and ``min_rows_per_write`` (``records_per_member``) makes Ray bundle at least that many rows per task. For cuts
fixed by the input alone, use ``write_dataset(source, records_per_member=..., executor=RayExecutor())``.

Ray reruns a write task whose worker died; the rerun rewrites the same member name with the same rows, so the
output does not change. An exception raised by a task (a bad sample) fails the write (``on_write_failed``): the
members written so far are removed and the folder's previous manifest, if any, stays current.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..format import arguments as check
from ..format import constants as C
from ..format.checksum import ALGORITHM
from ..format.schema import build_schema, parse_schema
from .sources import SampleError

try:  # the base class when Ray Data is installed: Ray checks isinstance(sink, Datasink)
    from ray.data import Datasink as _Base
except ImportError:  # pragma: no cover - without Ray the class still imports; constructing it says what to install
    _Base = object


class _Rows:
    """The rows of one write task as a pageset source: ``__len__`` / ``__getitem__`` -> dict of field values."""

    def __init__(self, rows: list, description: str):
        self.rows, self.description = rows, description

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class PagesetDatasink(_Base):
    """Write a Ray Dataset as a many-file pageset dataset (record files), one member per write task.

    Usage::

        import ray
        from pageset import PagesetDatasink, RGBImage, Int
        ds = ray.data.read_images("s3://bucket/photos/", include_paths=True)   # columns "image", "path"
        ds = ds.map(add_label)                                                   # a "label" column
        ds.write_datasink(PagesetDatasink("s3://bucket/train", {"image": RGBImage(max_resolution=512),
                                                                "label": Int()}, records_per_member=10_000))

    Args:
        path: the output folder or fsspec URL (created; as ``write_dataset(records_per_member=...)``'s ``path``).
        fields: ``{name: Field}`` in storage order; each name is a column of the Dataset's rows (other columns
            are ignored). Values as ``write_dataset`` takes them (image arrays HxWx3 uint8, encoded image bytes,
            paths, ints, floats, ...).
        records_per_member: at least this many rows per member (Ray Data's ``min_rows_per_write``; int >= 1, or
            None: Ray's own block sizes).
        page_size: bytes per page, a power of two in [4 KiB, 1 GiB] (default 8 MiB).
        append: add the members after those of the set already at ``path`` (a new manifest generation).
        on_error: ``"raise"`` (a bad row fails the write, nothing is listed) or ``"skip"`` (leave it out; its
            index within its member is recorded in the member's lineage).
        storage_options: fsspec options for a URL ``path`` (they travel to the write tasks).
        metadata: JSON-serialisable user metadata stored in every member (outside the dataset ids).
        lineage: record when, where and by which versions each member was written (outside the dataset ids);
            ``False``: members byte-identical across runs for the same rows.

    After ``write_datasink`` returns, :attr:`manifest` is the manifest written (members, ``dataset_id``, counts)
    on the driver. Raises (at construction, before Ray runs anything) TypeError / ValueError naming the
    argument; at the write, SampleError naming the member, the row within it and the field; ValueError when the
    set at ``path`` has another schema and ``append=True`` (naming the field).
    """

    def __init__(self, path, fields: dict, *, records_per_member: int | None = None,
                 page_size: int = C.DEFAULT_PAGE_SIZE, append: bool = False, on_error: str = "raise",
                 storage_options: dict | None = None, metadata: dict | None = None, lineage: bool = True):
        from .writer import _check_page_size, check_folder_path

        self.path = check_folder_path(path)
        fields = check.mapping("fields", fields, example="{'image': RGBImage(), 'label': Int()}")
        if not fields:
            raise ValueError("fields must name at least one column to store, e.g. {'image': RGBImage()}")
        self.records_per_member = check.integer("records_per_member", records_per_member, minimum=1, optional=True)
        _check_page_size(page_size)
        self.page_size = page_size
        self.append = check.boolean("append", append)
        self.on_error = check.choice("on_error", on_error, ("raise", "skip"))
        self.storage_options = check.mapping("storage_options", storage_options, optional=True)
        self.metadata = check.mapping("metadata", metadata, optional=True)
        self.lineage = check.boolean("lineage", lineage)
        if _Base is object:
            raise ImportError("PagesetDatasink needs Ray Data: pip install 'pageset[ray]' (or 'ray[data]')")
        check.json_metadata("metadata", self.metadata)
        self.fields = dict(fields)
        self.schema = build_schema(self.fields, {}, {"page_size": page_size, "checksum": ALGORITHM})
        _, self.row_dtype = parse_schema(self.schema)
        self.manifest = None
        self._started = None  # (previous manifest, generation, kept members, writer lock), set on the driver

    # ---- Ray Data's interface ---------------------------------------------------------------------------
    @property
    def min_rows_per_write(self) -> int | None:
        return self.records_per_member

    def get_name(self) -> str:
        return "Pageset"

    def on_write_start(self, schema=None) -> None:
        """Driver, before the tasks: check the folder, take the set's writer lock (held until
        on_write_complete / on_write_failed) and clean what killed writes left there."""
        from . import members as M

        call = "PagesetDatasink(path, fields)"
        self._started = M.prepare_folder(self.path, self.storage_options, "records", self.schema, self.append,
                                         call)

    def write(self, blocks, ctx) -> dict:
        """One write task: its rows -> member ``m<generation>-<task_idx>.pageset``; returns a small summary."""
        from ray.data.block import BlockAccessor

        from . import members as M
        from .tail import lineage as lineage_info

        previous, generation, kept, _lock = self._started  # (an inert copy of the driver's lock)
        rows = []
        for block in blocks:
            for row in BlockAccessor.for_block(block).iter_rows(public_row_format=True):
                rows.append(row if isinstance(row, Mapping) else dict(row))
        name = M.member_name(generation, ctx.task_idx)
        src = _task_source(rows, f"Ray Data write task {ctx.task_idx} (member {name})", self.fields)
        meta = lineage_info() if self.lineage else {}
        result = M.write_record_member(src, self.fields, self.row_dtype, self.schema, self.page_size, 0, len(rows),
                                       1024, self.on_error, self.path, name, self.storage_options, meta,
                                       self.metadata or {})
        result["task_idx"] = ctx.task_idx
        if "error" in result:
            i, field, detail, _tb, *where = result["error"]
            raise SampleError(where[0] if where else src.description, i, field, detail)
        if result.get("empty"):
            result["skipped"] = result.get("skipped", [])
        return result

    def on_write_complete(self, write_result) -> None:
        """Driver, after every task: the manifest over the kept members and the new ones (task order)."""
        from . import members as M

        previous, generation, kept, lock = self._started
        returns = getattr(write_result, "write_returns", write_result)
        done = sorted((s for s in returns if not s.get("empty")), key=lambda s: s["task_idx"])
        try:
            self.manifest = M.finish(self.path, "records", self.schema, self.page_size, previous, generation, kept,
                                     done, self.storage_options)
        finally:
            lock.release()

    def on_write_failed(self, error: Exception) -> None:
        """Driver: remove the members this write made; the previous manifest (if any) stays current."""
        from . import members as M

        if self._started is not None:
            try:
                M.abandon(self.path, self.storage_options, self._started[0])
            finally:
                self._started[3].release()


def _task_source(rows: list, description: str, fields: dict):
    """The rows as a write source (the pageset Source over a list of dicts), naming the task in errors."""
    from .sources import open_source

    src, _ = open_source(_Rows(rows, description), fields)
    src.description = description
    return src
