"""What ``pageset inspect`` and ``pageset verify`` print: a JSON-serialisable summary of a file or a many-file
set (:func:`describe`, :func:`describe_many`) and its text form, and the verification of every checksum."""

from __future__ import annotations

import json

import numpy as np

from .format.constants import ENCODING_NAMES
from .format.errors import plural
from .read import Dataset
from .write.output import is_url

_n = plural  # '1 document', '2 documents'


def describe(ds) -> dict:
    """A JSON-serialisable summary of an open dataset (what ``pageset inspect`` prints)."""
    fields = {}
    for name, field in ds.fields.items():
        info = {"kind": field.kind, "params": field.params()}
        if not field.inline:
            lengths = ds.index[f"{name}.length"].astype(np.int64)
            info["bytes"] = {"total": int(lengths.sum()), "mean": float(lengths.mean()), "max": int(lengths.max())}
        if field.kind == "rgb_image":
            h, w = ds.index[f"{name}.height"], ds.index[f"{name}.width"]
            enc = ds.index[f"{name}.encoding"]
            info["height"] = {"min": int(h.min()), "max": int(h.max()), "mean": float(h.mean())}
            info["width"] = {"min": int(w.min()), "max": int(w.max()), "mean": float(w.mean())}
            info["encodings"] = {ENCODING_NAMES[int(k)]: int((enc == k).sum()) for k in np.unique(enc)}
        if field.kind in ("int", "float"):
            col = ds.index[name]
            info["min"], info["max"] = col.min().item(), col.max().item()
            if field.kind == "int" and len(np.unique(col)) <= 1000:
                info["distinct"] = int(len(np.unique(col)))
        if field.kind == "tokens" and ds.tokens_info is not None:
            lengths = np.diff(ds.doc_offsets.astype(np.int64))
            info.update(ds.tokens_info)
            info["doc_tokens"] = ({"min": int(lengths.min()), "max": int(lengths.max()),
                                   "mean": float(lengths.mean())} if lengths.size else {})
        fields[name] = info
    header = {k: (v.decode("latin-1") if isinstance(v, bytes) else v) for k, v in ds.header.items()}
    return {
        "path": ds.path,
        "version": ".".join(map(str, ds.version)),
        "records": len(ds),
        "file_bytes": ds.file_size,
        "page_size": ds.page_size,
        "pages": ds.page_count,
        "dataset_id": ds.dataset_id,
        "header": header,
        "fields": fields,
        "attributes": ds.schema.get("attributes", {}),
        "writer": ds.schema.get("writer", {}),
        "lineage": ds.metadata.get("lineage", {}),
        "user_metadata": ds.metadata.get("user", {}),
    }


def _count(ds) -> str:
    """'N records', or for a token file 'T tokens in D documents'."""
    if ds.tokens_info is not None:
        return f"{_n(ds.tokens_info['count'], 'token')} in {_n(ds.tokens_info['documents'], 'document')}"
    return _n(len(ds), "record")


INSPECT_SKIPPED = 20  # skipped samples listed by the text form of ``inspect``


def describe_many(ds) -> dict:
    """A JSON-serialisable summary of a many-file dataset, from its manifest (what ``pageset inspect`` prints)."""
    m = ds.manifest
    out = {"path": ds.path, "kind": m.kind, "generation": m.generation, "dataset_id": m.dataset_id,
           "members": [{"name": x.name, "dataset_id": x.dataset_id, "bytes": x.bytes, "pages": x.pages,
                        **({"records": x.records} if m.kind == "records" else
                           {"tokens": x.tokens, "documents": x.documents})} for x in m.members],
           "bytes": sum(x.bytes for x in m.members), "pages": sum(x.pages for x in m.members),
           "page_size": m.page_size, "schema": m.schema, "appended_to": m.appended_to}
    if m.kind == "records":
        out["records"] = m.records
    else:
        out["tokens"], out["documents"] = m.tokens, m.documents
    return out


def _open_many(path: str, opts):
    from .read.set_dataset import ManyFileDataset, ManyFileTokens
    from .read.set_manifest import many_file_members

    path = path if not is_url(path) or path.endswith("/") else path + "/"
    kind = many_file_members(path, opts).kind
    return (ManyFileDataset if kind == "records" else ManyFileTokens)(path, opts)


def inspect(path: str, storage_options, as_json: bool, many: bool) -> int:
    """``pageset inspect``: print what the file (or, ``many``, the many-file set) at ``path`` holds, as text or
    ``as_json``; returns the exit code 0. The errors of opening it (FormatError, FileNotFoundError) propagate."""
    if many:
        with _open_many(path, storage_options) as ds:
            info = describe_many(ds)
        if as_json:
            print(json.dumps(info, indent=2, sort_keys=True))
            return 0
        count = (_n(info["records"], "record") if info["kind"] == "records" else
                 f"{_n(info['tokens'], 'token')} in {_n(info['documents'], 'document')}")
        print(f"{info['path']}: many-file pageset dataset (manifest generation {info['generation']}), "
              f"{_n(len(info['members']), 'member')}, {count}, {info['bytes'] / 1e6:.2f} MB, "
              f"{_n(info['pages'], 'page')} of {info['page_size']} bytes")
        print(f"dataset id: {info['dataset_id']}")
        for f in info["schema"].get("fields", []):
            print(f"  {f['name']}: {f['kind']} {f['params']}")
        for x in info["members"][:INSPECT_SKIPPED]:
            n = _n(x["records"], "record") if "records" in x else _n(x["tokens"], "token")
            print(f"  member {x['name']}: {n}, {x['bytes'] / 1e6:.2f} MB, id {x['dataset_id'][:16]}")
        if len(info["members"]) > INSPECT_SKIPPED:
            print(f"  ... {len(info['members']) - INSPECT_SKIPPED} more members (all of them: pageset inspect --json)")
        return 0
    with Dataset(path, storage_options) as ds:  # either kind of file
        info = describe(ds)
        count = _count(ds)
    if as_json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"{info['path']}: pageset v{info['version']}, {count}, "
          f"{info['file_bytes'] / 1e6:.2f} MB, {_n(info['pages'], 'page')} of {info['page_size']} bytes")
    print(f"dataset id: {info['dataset_id']}")
    for name, f in info["fields"].items():
        extra = ""
        if f["kind"] == "rgb_image":
            extra = (f" {f['width']['min']}-{f['width']['max']} x {f['height']['min']}-{f['height']['max']} px,"
                     f" encodings {f['encodings']}")
        elif f["kind"] == "tokens":
            tok = f.get("tokenizer") or {}
            extra = (f" {_n(f['count'], 'token')} in {_n(f['documents'], 'document')} (mean {f['doc_tokens'].get('mean', 0):.0f}),"
                     f" eos_id {f['eos_id']}, bos_id {f['bos_id']}, tokenizer {tok.get('name')}")
        elif "min" in f:
            extra = f" range [{f['min']}, {f['max']}]"
        size = f" {f['bytes']['total'] / 1e6:.2f} MB (mean {f['bytes']['mean']:.0f} B)" if "bytes" in f else ""
        print(f"  {name}: {f['kind']} {f['params']}{size}{extra}")
    classes = info["attributes"].get("class_names")
    if classes:
        print(f"classes ({len(classes)}): {classes[:10]}{' ...' if len(classes) > 10 else ''}")
    lin = info["lineage"]
    if lin:
        print(f"written {lin.get('created_utc')} on {lin.get('host')} by pageset {lin.get('pageset_version')} "
              f"from {lin.get('source')}; skipped {len(lin.get('skipped', []))}")
        # on_error="skip" records what it left out; convert's message points here for the list.
        errors = lin.get("skipped_errors") or [{"index": i} for i in lin.get("skipped", [])]
        for e in errors[:INSPECT_SKIPPED]:
            where = f", field {e['field']!r}" if e.get("field") else ""
            print(f"  skipped sample {e.get('index')}{where}: {e.get('error', '(no error recorded)')}")
        if len(errors) > INSPECT_SKIPPED:
            print(f"  ... {len(errors) - INSPECT_SKIPPED} more (all of them: pageset inspect --json)")
    return 0


def verify(path: str, storage_options, many: bool) -> int:
    """``pageset verify``: verify every checksum of the file (or, ``many``, every member of the set) at ``path``
    and print what was checked; returns 0. FormatError subclasses naming what is damaged propagate."""
    if many:
        with _open_many(path, storage_options) as ds:
            ds.verify()
            print(f"{path}: OK ({_n(len(ds.members), 'member')}, {_n(sum(m.pages for m in ds.members), 'page')}: "
                  "the manifest, and every member's header, sections, index, page checksums and dataset id "
                  "against the manifest verified)")
        return 0
    with Dataset(path, storage_options) as ds:  # either kind of file
        ds.verify()
        print(f"{path}: OK ({_count(ds)}, {_n(ds.page_count, 'page')}, header, sections, index and every page "
              "checksum verified)")
    return 0
