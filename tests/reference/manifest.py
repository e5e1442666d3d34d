"""A reference reader of many-file datasets (manifest 1.0), written from ``formats/manyfile.md`` alone.

Standard library only, no import of pageset; members are read with the reference reader of ``format.py``.

    ref = read_set(folder)     # RefSet: .manifest (dict), .members (list of RefDataset), .dataset_id (hex)
    ref.records                # every record of every member, in global id order (spec section 2)
    ref.records_per_page       # list of lists of ints: each member's decoded records_per_page (section 4)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import zlib

from .format import RefError, read_file

PER_MEMBER = {"attributes": ("ignored_files",), "tokens": ("count", "documents", "max_id")}  # section 3


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def common(schema: dict) -> dict:
    out = json.loads(json.dumps(schema))
    for key, drop in PER_MEMBER.items():
        for k in drop if isinstance(out.get(key), dict) else ():
            out[key].pop(k, None)
    return out


def set_id(ids_hex: list[str]) -> str:  # section 5
    return hashlib.sha256(b"pageset many-file v1\n" + b"".join(bytes.fromhex(i) for i in ids_hex)).hexdigest()


class RefSet:
    def __init__(self, folder: str):
        with open(os.path.join(folder, "pageset.manifest.json"), "rb") as f:
            m = json.loads(f.read().decode("utf-8"))
        if m.get("format") != "pageset-manifest" or m.get("version", [0])[0] != 1:
            raise RefError("not a manifest of major version 1")
        if hashlib.sha256(canonical(m["schema"])).hexdigest() != m["schema_digest"]:
            raise RefError("schema_digest is not the digest of schema")
        if set_id([e["dataset_id"] for e in m["members"]]) != m["dataset_id"]:
            raise RefError("dataset_id is not the digest of the members' ids")
        self.manifest, self.dataset_id, self.members, self.records_per_page = m, m["dataset_id"], [], []
        for e in m["members"]:
            if "/" in e["name"] or e["name"] == "pageset.manifest.json":
                raise RefError(f"member name {e['name']!r} is not a file name in the folder")
            ref = read_file(os.path.join(folder, e["name"]))
            h = ref.header
            if (h["dataset_id"].hex(), h["file_size"], h["page_count"]) != (e["dataset_id"], e["bytes"], e["pages"]):
                raise RefError(f"member {e['name']}: header differs from its manifest entry")
            if canonical(common(ref.schema)) != canonical(m["schema"]) or e["schema_digest"] != m["schema_digest"]:
                raise RefError(f"member {e['name']}: schema differs from the set's")
            if m["kind"] == "records":
                raw = zlib.decompress(base64.b64decode(e["records_per_page"], validate=True))
                rpp = list(struct.unpack(f"<{len(raw) // 4}I", raw))
                last = max(h["page_count"] - 1, 0)
                want = [0] * max(h["page_count"], 1)
                for r in ref.records:  # the page of each record's first byte, clamped (section 4)
                    want[min((r["_offset"] - h["data_offset"]) // h["page_size"], last)] += 1
                if rpp != want or e["records"] != h["record_count"]:
                    raise RefError(f"member {e['name']}: records_per_page or records differ from the member's")
                self.records_per_page.append(rpp)
            self.members.append(ref)

    @property
    def records(self) -> list[dict]:
        return [r for ref in self.members for r in ref.records]


def read_set(folder) -> RefSet:
    return RefSet(os.fspath(folder))
