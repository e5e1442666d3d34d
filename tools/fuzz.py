"""Fuzz the reader, the token reader and the Loader with mutated pageset files (issue 6, part 1).

    .venv/bin/python tools/fuzz.py --files 10000 [--jobs 2] [--seed 0] [--json out/fuzz.json]

Two small valid seed files are written first: an image/record file (real photos as JPEG and raw, plus Int,
NDArray, Bytes and JSON fields, 4 KiB pages) and a token file (pre-tokenized uint16 ids). Each mutation
``i`` is a pure function of ``(seed, i)`` and is applied to one of them:

- ``flip``: 1-4 random bit flips (no checksum fixed: exercises the CRC checks);
- ``flip_fixed``: bit flips in the header, section table or a section, then every section CRC, the section
  table CRC and the header CRC are recomputed, so the damage reaches the semantic checks behind them;
- ``truncate`` / ``extend`` (optionally with ``file_size`` fixed in the header);
- ``header``: a header field set to an interesting value (0, 1, 2^31, 2^32, 2^63, 2^64 - 1, the file size,
  neighbours of the old value, ...), CRCs fixed;
- ``entry``: a section table entry's kind / flags / offset / length edited, CRCs fixed;
- ``index``: one index cell (any column) edited, CRCs fixed;
- ``doc_offsets``: one token document offset edited, CRCs fixed;
- ``page_crc``: a stored page CRC edited, CRCs fixed;
- ``swap``: two section table entries (or their kinds) swapped, CRCs fixed;
- ``schema``: a leaf of the schema JSON replaced / deleted, the tail relaid out with the writer's own
  ``write_tail`` (every CRC valid).

The dataset id (a SHA-256 over schema, index and page CRCs) is never recomputed, so ``verify()`` can tell any
content change. For each mutated file the worker opens it (``open_dataset`` / ``open_tokens``), calls
``verify()``, reads every record (and ``to_numpy()`` of every image) or every token, and runs one Loader epoch.
Allowed outcomes: the ORIGINAL data (a mutation of padding, reserved bytes or metadata), or a
``pageset.FormatError`` subclass. Anything else fails: another exception type, a MemoryError, different data
returned without an error, a crash of the worker process (signal) or a hang (no progress for ``--timeout``
seconds): the parent runs the loop in child processes, so a segfault is reported with its mutation.

Files that open but fail ``verify()`` (garbage JPEG bytes in a page, say) are also read and loaded once more
as a crash test: there any exception is accepted and counted by type (the file was reported damaged; a
MemoryError there is a loader finding, listed in the summary), only a crash or a hang fails.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- seed files --------------------------------------------------------------------------------------------


def seed_samples() -> tuple[list, dict, list]:
    """The seed files' content: (image samples, their fields, token documents); deterministic."""
    from PIL import Image

    from pageset import JSON, Bytes, Int, NDArray, RGBImage
    from pageset.sample_data import wheel_photos

    photos = wheel_photos()[:6]
    samples = []
    for k, p in enumerate(photos):
        with Image.open(p) as img:
            img = img.convert("RGB")
            small = np.asarray(img.resize((40 + 4 * k, 32 + 2 * k)))
            tiny = np.asarray(img.resize((6 + k, 5 + k)))
        samples.append((small, tiny, k, np.arange(3, dtype=np.float32) * k, bytes([k]) * (5 * k),
                        {"k": k, "name": os.path.basename(p)}))
    fields = {"image": RGBImage(encoding="jpeg", jpeg_quality=80), "raw": RGBImage(encoding="raw"),
              "label": Int(), "arr": NDArray("float32", (3,)), "blob": Bytes(), "meta": JSON()}
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50000, size=int(n)).astype(np.int64) for n in rng.integers(50, 700, size=8)]
    return samples, fields, docs


def build_seeds(folder: str) -> dict:
    """Write the two seed files into ``folder``; returns ``{"image": path, "tokens": path}``."""
    from pageset import write_dataset, write_tokens

    samples, fields, docs = seed_samples()
    img_path = os.path.join(folder, "image.pageset")
    write_dataset(img_path, samples, fields, num_workers=0, page_size=4096, progress=False)
    tok_path = os.path.join(folder, "tokens.pageset")
    write_tokens(tok_path, docs, None, eos_id=0, num_workers=0, progress=False, page_size=4096)
    return {"image": img_path, "tokens": tok_path}


# ---- reading a file completely -----------------------------------------------------------------------------


def _norm(value):
    from pageset.read.reader import EncodedImage

    if isinstance(value, EncodedImage):
        return ("img", value.height, value.width, value.encoding, value.data, value.to_numpy().tobytes())
    if isinstance(value, np.ndarray):
        return ("nd", value.dtype.str, value.shape, value.tobytes())
    if hasattr(value, "numpy"):  # a torch tensor
        return _norm(value.numpy())
    if isinstance(value, tuple):
        return tuple(_norm(v) for v in value)
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def read_image_file(path: str, verify: bool = True):
    """Open, verify, read every record (images decoded): a comparable snapshot."""
    from pageset import open_dataset

    with open_dataset(path) as ds:
        if verify:
            ds.verify()
        return [_norm(ds[i]) for i in range(len(ds))]


def read_token_file(path: str, verify: bool = True):
    from pageset import open_tokens

    with open_tokens(path) as td:
        if verify:
            td.dataset.verify()
        docs = [td.document(i).tobytes() for i in range(td.documents)]
        return (td.tokens.tobytes(), td.doc_offsets.tobytes(), td.eos_id, td.dtype.str, docs, td.num_windows(16))


def load_image_file(path: str):
    from pageset import Loader, RandomResizedCrop

    pipes = {"image": [RandomResizedCrop(16)], "raw": [RandomResizedCrop(4)]}
    with Loader(path, batch_size=2, pipelines=pipes, num_threads=1, seed=3) as loader:
        return [_norm(b) for b in loader]


def load_token_file(path: str):
    from pageset import Loader
    from pageset.ops.transforms import TokenWindows

    with Loader(path, batch_size=2, pipelines={"tokens": [TokenWindows(16, document_outputs=True)]},
                num_threads=1, seed=3, order="quasi_random") as loader:
        return [_norm(b) for b in loader]


READERS = {"image": (read_image_file, load_image_file), "tokens": (read_token_file, load_token_file)}

# ---- file structure helpers --------------------------------------------------------------------------------


def _structure(data: bytes):
    """(header record copy, section table copy or None, table offset) parsed leniently from ``data``."""
    from pageset.format.constants import HEADER_SIZE
    from pageset.format.layout import HEADER, SECTION_ENTRY

    if len(data) < HEADER_SIZE:
        return None, None, 0
    h = np.frombuffer(bytes(data[:HEADER_SIZE]), dtype=HEADER).copy()
    off, count = int(h[0]["section_table_offset"]), int(h[0]["section_count"])
    if count > 4096 or off + count * SECTION_ENTRY.itemsize > len(data):
        return h, None, off
    table = np.frombuffer(bytes(data[off : off + count * SECTION_ENTRY.itemsize]), dtype=SECTION_ENTRY).copy()
    return h, table, off


def fix_crcs(data: bytearray, sections: bool = True) -> bytearray:
    """Recompute every in-file section CRC (if ``sections``), the section table CRC and the header CRC."""
    from pageset.format.checksum import crc32
    from pageset.format.constants import HEADER_SIZE

    h, table, off = _structure(data)
    if h is None:
        return data
    if table is not None:
        if sections:
            for e in table:
                s_off, s_len = int(e["offset"]), int(e["length"])
                if s_off + s_len <= len(data):
                    e["crc"] = crc32(bytes(data[s_off : s_off + s_len]))
        data[off : off + table.nbytes] = table.tobytes()
        h[0]["section_table_crc"] = crc32(table.tobytes())
    raw = bytearray(h.tobytes())
    raw[-4:] = crc32(bytes(raw[:-4])).to_bytes(4, "little")
    data[:HEADER_SIZE] = raw
    return data


def _section(data, kind):
    _, table, _ = _structure(data)
    for e in table:
        if int(e["kind"]) == kind:
            return int(e["offset"]), int(e["length"])
    return None


def _interesting(rng: random.Random, old: int, bits: int, size: int) -> int:
    mask = (1 << bits) - 1
    cands = [0, 1, 2, 3, 7, 8, 16, 4095, 4096, 4097, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
             1 << 32, (1 << 63) - 1, 1 << 63, mask, size, size - 1, size + 1, size - 4096, old + 1, old - 1,
             old * 2, old // 2, old + 4096, old - 4096, old ^ (1 << rng.randrange(bits)), rng.getrandbits(bits),
             rng.randrange(max(size, 1))]
    return rng.choice(cands) & mask


# ---- mutations ---------------------------------------------------------------------------------------------

HEADER_FIELDS = ("major", "minor", "header_size", "page_size", "required_features", "optional_features",
                 "record_count", "data_offset", "data_length", "page_count", "section_table_offset",
                 "section_count", "file_size", "section_table_crc")
ENTRY_FIELDS = ("kind", "flags", "offset", "length", "crc", "reserved")
KINDS_IMAGE = ("flip", "flip", "flip_fixed", "flip_fixed", "truncate", "extend", "header", "header", "entry",
               "entry", "index", "index", "index", "page_crc", "swap", "schema", "schema")
KINDS_TOKENS = ("flip", "flip", "flip_fixed", "flip_fixed", "truncate", "extend", "header", "header", "entry",
                "entry", "doc_offsets", "doc_offsets", "doc_offsets", "page_crc", "swap", "schema", "schema")


def _set_word(data: bytearray, pos: int, nbytes: int, value: int) -> None:
    data[pos : pos + nbytes] = (value & ((1 << (8 * nbytes)) - 1)).to_bytes(nbytes, "little")


def _mutate_schema(rng: random.Random, doc):
    """Replace, delete or add one node of the JSON document (in place on a copy); returns the new doc."""
    doc = json.loads(json.dumps(doc))
    values = [0, -1, 1, 2, 3, 65536, 1 << 31, 1 << 40, 1 << 64, -(1 << 63), 1.5, 1e308, "", "x", None, True,
              False, [], {}, [0], [1, 2], [1 << 40, 1 << 40], "uint64", "uint16", "uint32", "float16", "int8",
              "bool", "<u8", "<u4", "u1", "ndarray", "bytes", "json", "int", "float", "rgb_image", "tokens",
              "raw", "jpeg", "image", "label", "tokens.offset", "_offset", "a.b", "\x00"]
    # collect every (container, key) pair
    nodes = []

    def walk(x):
        if isinstance(x, dict):
            for k in x:
                nodes.append((x, k))
                walk(x[k])
        elif isinstance(x, list):
            for k in range(len(x)):
                nodes.append((x, k))
                walk(x[k])

    walk(doc)
    if not nodes:
        return doc
    cont, key = rng.choice(nodes)
    op = rng.random()
    if op < 0.6:
        cont[key] = rng.choice(values)
    elif op < 0.75:
        del cont[key]
    elif op < 0.85 and isinstance(cont, list):
        cont.insert(rng.randrange(len(cont) + 1), json.loads(json.dumps(rng.choice(cont))))
    elif op < 0.95 and isinstance(cont, list) and len(cont) > 1:
        j = rng.randrange(len(cont))
        cont[key], cont[j] = cont[j], cont[key]
    else:
        if isinstance(cont, dict):
            cont[rng.choice(["extra", "dtype", "shape", "count", "eos_id", "params", "kind"])] = rng.choice(values)
        else:
            cont[key] = rng.choice(values)
    return doc


def _relayout(orig: bytes, schema_payload: bytes) -> bytearray:
    """The file ``orig`` with its schema section replaced (any length), written with the writer's write_tail:
    every CRC valid, the dataset id unchanged."""
    from pageset.format import constants as C
    from pageset.write.tail import write_tail

    h, table, _ = _structure(orig)
    h = h[0]
    sections = []
    for e in table:
        off, length = int(e["offset"]), int(e["length"])
        payload = schema_payload if int(e["kind"]) == C.SECTION_SCHEMA else bytes(orig[off : off + length])
        sections.append((int(e["kind"]), int(e["flags"]), payload))
    data_end = int(h["data_offset"]) + int(h["data_length"])
    f = io.BytesIO()
    f.write(orig[:data_end])
    write_tail(f, page_size=int(h["page_size"]), data_length=int(h["data_length"]),
               page_count=int(h["page_count"]), record_count=int(h["record_count"]),
               required_features=int(h["required_features"]), dataset_id=bytes(h["dataset_id"]),
               sections=sections)
    return bytearray(f.getvalue())


def mutate(orig: bytes, kind_name: str, seed: int, i: int) -> tuple[bytes, str]:
    """Mutation ``i`` of the seed file ``orig``: (new bytes, a one-line description)."""
    from pageset.format import constants as C
    from pageset.format.layout import HEADER, SECTION_ENTRY
    from pageset.format.schema import parse_schema

    rng = random.Random(f"{seed}:{kind_name}:{i}")
    kind = rng.choice(KINDS_IMAGE if kind_name == "image" else KINDS_TOKENS)
    data = bytearray(orig)
    size = len(data)
    h, table, table_off = _structure(orig)
    data_end = int(h[0]["data_offset"]) + int(h[0]["data_length"])
    struct_regions = [(0, C.HEADER_SIZE), (table_off, table_off + table.nbytes)]
    struct_regions += [(int(e["offset"]), int(e["offset"]) + int(e["length"])) for e in table if int(e["length"])]

    def pick_pos(structural: bool) -> int:
        if structural:
            lo, hi = rng.choice(struct_regions)
            return rng.randrange(lo, hi)
        return rng.randrange(size)

    if kind in ("flip", "flip_fixed"):
        n = rng.randint(1, 4)
        positions = []
        for _ in range(n):
            pos = pick_pos(kind == "flip_fixed" or rng.random() < 0.5)
            if kind == "flip_fixed" and pos in range(C.HEADER_SIZE - 4, C.HEADER_SIZE):
                pos -= 8  # the header CRC itself is recomputed anyway
            bit = rng.randrange(8)
            data[pos] ^= 1 << bit
            positions.append(f"{pos}.{bit}")
        if kind == "flip_fixed":
            fix_crcs(data)
        return bytes(data), f"{kind} {','.join(positions)}"
    if kind == "truncate":
        cut = rng.choice([rng.randrange(size), rng.randrange(data_end, size), size - rng.randint(1, 64),
                          rng.choice([0, 7, 8, 100, 159, 160, C.DATA_OFFSET, data_end])])
        data = data[:cut]
        fixed = rng.random() < 0.5 and cut >= C.HEADER_SIZE
        if fixed:
            hh = np.frombuffer(bytes(data[: C.HEADER_SIZE]), dtype=HEADER).copy()
            hh[0]["file_size"] = cut
            data[: C.HEADER_SIZE] = hh.tobytes()
            fix_crcs(data, sections=rng.random() < 0.5)
        return bytes(data), f"truncate to {cut}{' (file_size fixed)' if fixed else ''}"
    if kind == "extend":
        extra = bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 7, 8, 32, 4096])))
        data += extra
        fixed = rng.random() < 0.5
        if fixed:
            hh = np.frombuffer(bytes(data[: C.HEADER_SIZE]), dtype=HEADER).copy()
            hh[0]["file_size"] = len(data)
            data[: C.HEADER_SIZE] = hh.tobytes()
            fix_crcs(data)
        return bytes(data), f"extend by {len(extra)}{' (file_size fixed)' if fixed else ''}"
    if kind == "header":
        name = rng.choice(HEADER_FIELDS)
        off = HEADER.fields[name][1]
        nbytes = HEADER.fields[name][0].itemsize
        old = int.from_bytes(data[off : off + nbytes], "little")
        new = _interesting(rng, old, 8 * nbytes, size)
        _set_word(data, off, nbytes, new)
        fix_crcs(data, sections=rng.random() < 0.8)
        if name == "section_table_crc":  # keep the edited value: recompute only the header CRC
            _set_word(data, off, nbytes, new)
            _fix_header_only(data)
        return bytes(data), f"header {name} {old} -> {new}"
    if kind == "entry":
        k = rng.randrange(len(table))
        name = rng.choice(ENTRY_FIELDS)
        pos = table_off + k * SECTION_ENTRY.itemsize + SECTION_ENTRY.fields[name][1]
        nbytes = SECTION_ENTRY.fields[name][0].itemsize
        old = int.from_bytes(data[pos : pos + nbytes], "little")
        new = _interesting(rng, old, 8 * nbytes, size)
        if name == "kind" and rng.random() < 0.5:
            new = rng.choice([0, 1, 2, 3, 4, 5, 6, 99])
        _set_word(data, pos, nbytes, new)
        fix_crcs(data, sections=name != "crc")
        return bytes(data), f"entry {k} {name} {old} -> {new}"
    if kind in ("index", "doc_offsets", "page_crc"):
        sec_kind = {"index": C.SECTION_INDEX, "doc_offsets": C.SECTION_DOC_OFFSETS,
                    "page_crc": C.SECTION_PAGE_CHECKSUMS}[kind]
        s_off, s_len = _section(orig, sec_kind)
        if kind == "index":
            sch_off, sch_len = _section(orig, C.SECTION_SCHEMA)
            _, row = parse_schema(json.loads(bytes(orig[sch_off : sch_off + sch_len])))
            n = s_len // row.itemsize
            r = rng.randrange(n)
            col = rng.choice(row.names)
            fdt, coff = row.fields[col][0], row.fields[col][1]
            pos = s_off + r * row.itemsize + coff
            nbytes = fdt.itemsize
            label = f"row {r} {col}"
        else:
            nbytes = 8 if kind == "doc_offsets" else 4
            r = rng.randrange(s_len // nbytes)
            pos = s_off + r * nbytes
            label = f"entry {r}"
        old = int.from_bytes(data[pos : pos + nbytes], "little")
        new = _interesting(rng, old, 8 * nbytes, size)
        if kind == "index" and rng.random() < 0.3:  # another row's value of the same column
            r2 = rng.randrange(n)
            new = int.from_bytes(data[s_off + r2 * row.itemsize + coff : s_off + r2 * row.itemsize + coff + nbytes],
                                 "little")
        _set_word(data, pos, nbytes, new)
        fix_crcs(data)
        return bytes(data), f"{kind} {label} {old} -> {new}"
    if kind == "swap":
        a, b = rng.sample(range(len(table)), 2)
        t2 = table.copy()
        if rng.random() < 0.5:
            t2[a], t2[b] = table[b], table[a]
            what = "entries"
        else:
            t2[a]["kind"], t2[b]["kind"] = table[b]["kind"], table[a]["kind"]
            what = "kinds"
        data[table_off : table_off + t2.nbytes] = t2.tobytes()
        fix_crcs(data)
        return bytes(data), f"swap section {what} {a} <-> {b}"
    if kind == "schema":
        sch_off, sch_len = _section(orig, C.SECTION_SCHEMA)
        doc = json.loads(bytes(orig[sch_off : sch_off + sch_len]))
        new = _mutate_schema(rng, doc)
        payload = json.dumps(new, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        return bytes(_relayout(orig, payload)), f"schema {payload[:300]!r}"
    raise AssertionError(kind)


def _fix_header_only(data: bytearray) -> None:
    from pageset.format.checksum import crc32
    from pageset.format.constants import HEADER_SIZE

    data[HEADER_SIZE - 4 : HEADER_SIZE] = crc32(bytes(data[: HEADER_SIZE - 4])).to_bytes(4, "little")


# ---- checking one mutated file -----------------------------------------------------------------------------


def check_file(path: str, kind: str, baseline) -> str:
    """The outcome of one mutated file: ``"same"``, ``"detected:<FormatError subclass>"`` or
    ``"FAIL:<reason>"``."""
    from pageset import FormatError

    read, load = READERS[kind]
    try:
        snapshot = read(path)
    except FormatError as exc:
        outcome = f"detected:{type(exc).__name__}"
        _crash_test(path, kind)
        return outcome
    except MemoryError:
        return "FAIL:MemoryError while reading"
    except Exception as exc:  # noqa: BLE001 - every other type is a finding
        return f"FAIL:read raised {type(exc).__name__}: {exc}"[:500]
    if snapshot != baseline[0]:
        return "FAIL:verified file returned different data"
    try:
        batches = load(path)
    except FormatError as exc:
        return f"detected:{type(exc).__name__} (loader)"
    except MemoryError:
        return "FAIL:MemoryError while loading"
    except Exception as exc:  # noqa: BLE001
        return f"FAIL:loader raised {type(exc).__name__}: {exc}"[:500]
    if batches != baseline[1]:
        return "FAIL:loader returned different batches"
    return "same"


CRASH_TEST_ERRORS: collections.Counter = collections.Counter()


def _crash_test(path: str, kind: str) -> None:
    """A file that opens but fails verify(): read and load it anyway; any exception is fine (the user was told
    the file is damaged), but a crash or hang is not, and MemoryError is re-raised as a failure."""
    from pageset import Dataset, FormatError

    try:
        with Dataset(path):  # either kind of file
            pass
    except FormatError:
        return  # refused at open: nothing reaches the kernels
    read, load = READERS[kind]
    for what, fn in (("read", lambda: read(path, verify=False)), ("load", lambda: load(path))):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - MemoryError included: counted and reported, see the module doc
            CRASH_TEST_ERRORS[f"{what}:{type(exc).__name__}"] += 1


# ---- the worker loop (a child process) ---------------------------------------------------------------------


def worker(seed_dir: str, seed: int, start: int, stop: int, scratch: str) -> None:
    seeds = {k: os.path.join(seed_dir, f"{k}.pageset") for k in READERS}
    origs = {k: open(p, "rb").read() for k, p in seeds.items()}
    baselines = {k: (READERS[k][0](p), READERS[k][1](p)) for k, p in seeds.items()}
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    kinds = sorted(READERS)
    for i in range(start, stop):
        kind = kinds[i % len(kinds)]
        data, desc = mutate(origs[kind], kind, seed, i)
        out.write(json.dumps({"start": i, "kind": kind, "desc": desc}) + "\n")
        out.flush()
        path = os.path.join(scratch, f"m{i % 2}.pageset")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        try:
            outcome = "same" if data == origs[kind] else check_file(path, kind, baselines[kind])
        except Exception as exc:  # noqa: BLE001
            outcome = f"FAIL:fuzzer raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"[:2000]
        out.write(json.dumps({"done": i, "outcome": outcome}) + "\n")
        out.flush()
    out.write(json.dumps({"crash_test_errors": dict(CRASH_TEST_ERRORS)}) + "\n")
    out.flush()


# ---- the parent: run workers, survive their crashes --------------------------------------------------------


def _memory_limit():
    import resource

    # 4 GiB of address space... numba/LLVM and torch map more than that; cap data instead (heap growth).
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (6 << 30, 6 << 30))
    except (ValueError, OSError):
        pass


def _pump(stream, put, end_marker: bool) -> None:
    for line in stream:
        put(line)
    if end_marker:
        put(None)


def _run_range(seed_dir, seed, start, stop, timeout, results, lock, log):
    """Run mutations [start, stop) in child processes; a crash or hang is recorded and the child restarted."""
    nxt = start
    while nxt < stop:
        scratch = tempfile.mkdtemp(prefix="pageset-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed-dir", seed_dir, "--seed", str(seed),
               "--start", str(nxt), "--stop", str(stop), "--scratch", scratch]
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=_memory_limit)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines.put, True), daemon=True).start()
        err_tail: collections.deque = collections.deque(maxlen=60)
        threading.Thread(target=_pump, args=(proc.stderr, err_tail.append, False), daemon=True).start()
        current = None
        ready = False
        while True:
            try:
                line = lines.get(timeout=timeout if ready else max(timeout, 300))
            except queue.Empty:
                proc.kill()
                proc.wait()
                reason = f"FAIL:hang (no progress for {timeout} s)"
                break
            if line is None:
                rc = proc.wait()
                reason = None if rc == 0 and current is None else f"FAIL:worker died (exit {rc})"
                break
            msg = json.loads(line)
            if "ready" in msg:
                ready = True
            elif "start" in msg:
                current = msg
            elif "done" in msg:
                with lock:
                    results.append((current["start"], current["kind"], current["desc"], msg["outcome"]))
                nxt = current["start"] + 1
                current = None
            elif "crash_test_errors" in msg:
                with lock:
                    for k, v in msg["crash_test_errors"].items():
                        results.crash_errors[k] += v
        for name in os.listdir(scratch):
            os.unlink(os.path.join(scratch, name))
        os.rmdir(scratch)
        if reason is None:
            return
        if current is None:  # died before the first mutation: nothing to blame; give up on this range
            with lock:
                results.append((nxt, "?", "worker start", f"{reason}; stderr: {''.join(err_tail)[-2000:]}"))
            return
        with lock:
            results.append((current["start"], current["kind"], current["desc"],
                            f"{reason}; stderr: {''.join(err_tail)[-2000:]}"))
        log(f"  mutation {current['start']} ({current['desc'][:120]}): {reason}")
        nxt = current["start"] + 1


class _Results(list):
    def __init__(self):
        super().__init__()
        self.crash_errors: collections.Counter = collections.Counter()


def run(files: int, seed: int = 0, jobs: int = 1, timeout: float = 60.0, seed_dir: str | None = None,
        log=print) -> dict:
    """Run ``files`` mutations in ``jobs`` child processes; returns a summary dict (``failures`` listed)."""
    t0 = time.perf_counter()
    own = seed_dir is None
    if own:
        seed_dir = tempfile.mkdtemp(prefix="pageset-fuzz-seeds-")
        build_seeds(seed_dir)
    results = _Results()
    lock = threading.Lock()
    bounds = np.linspace(0, files, jobs + 1).astype(int)
    threads = [threading.Thread(target=_run_range, args=(seed_dir, seed, int(a), int(b), timeout, results, lock,
                                                         log)) for a, b in zip(bounds[:-1], bounds[1:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if own:
        for name in os.listdir(seed_dir):
            os.unlink(os.path.join(seed_dir, name))
        os.rmdir(seed_dir)
    outcomes = collections.Counter(r[3].split(" (")[0] if not r[3].startswith("FAIL") else "FAIL" for r in results)
    by_kind = collections.Counter(f"{r[1]}:{r[2].split(' ')[0]}" for r in results)
    failures = [r for r in results if r[3].startswith("FAIL")]
    return {"files": len(results), "seconds": round(time.perf_counter() - t0, 1), "seed": seed,
            "outcomes": dict(sorted(outcomes.items())), "mutations": dict(sorted(by_kind.items())),
            "crash_test_errors": dict(results.crash_errors), "failures": failures[:50],
            "failure_count": len(failures)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=10000, help="mutated files to check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=max(1, min(os.cpu_count() or 1, 4)))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without progress that count as a hang")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed-dir", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.seed_dir, a.seed, a.start, a.stop, a.scratch)
        return 0
    summary = run(a.files, a.seed, a.jobs, a.timeout)
    print(f"mutated files: {summary['files']} in {summary['seconds']} s ({a.jobs} jobs, seed {a.seed})")
    for k, v in summary["outcomes"].items():
        print(f"  {k:45s} {v}")
    print(f"non-FormatError outcomes: {summary['failure_count']}")
    print(f"crash-test exceptions on files that fail verify(): {summary['crash_test_errors']}")
    for f in summary["failures"][:20]:
        print(f"  FAIL {f[0]} {f[1]} {f[2][:150]}: {f[3][:400]}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
    return 1 if summary["failure_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
