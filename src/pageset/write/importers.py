"""Import existing token files into pageset token files, losslessly (the stream is copied verbatim).

Source formats:

- nanoGPT (``data/*/prepare.py``): a headerless ``.bin`` of ``uint16`` ids (dtype given), one EOT appended
  after each document. Boundaries: after each ``eos_id``.
- llm.c (``dev/data/data_common.py``): a 1024-byte header of 256 little-endian int32 (``[0]`` magic
  20240520 with ``[1]`` version 1 and uint16 tokens (GPT-2), or magic 20240801 with version 7 and uint32 tokens
  (Llama 3); ``[2]`` token count), then the tokens. llm.c puts EOT BEFORE each document, so boundaries are at
  each ``eos_id``.
- Megatron-LM ``IndexedDataset`` (``MMIDIDX``): a ``.idx`` (magic ``MMIDIDX\\x00\\x00``, u64 version 1, u8 dtype
  code, u64 sequence count, u64 document count, int32 sizes, int64 byte pointers, int64 doc_idx) and a ``.bin``
  of tokens. Document boundaries come from doc_idx (sequence indices of document starts).

A stream that does not end with ``eos_id`` keeps its last document without one (stored verbatim; ``info``
records ``"source"``). Every length and pointer read from a source is checked against its file size.
"""

from __future__ import annotations

import os
import struct
import time

import numpy as np

from ..format import arguments as check
from ..format import constants as C
from .output import check_not_input, check_output_path, check_replaceable, is_url
from .tokens import UINT16_MAX, UINT32_MAX, TokenFileWriter, TokenWriteResult
from .writer import _check_page_size

LLMC_HEADER_INTS = 256
LLMC_KINDS = {(20240520, 1): np.dtype("<u2"), (20240801, 7): np.dtype("<u4")}
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}
COPY_CHUNK = 1 << 22  # tokens per copy step (8-16 MiB)


def boundaries_at_eos(tokens: np.ndarray, eos_id: int | None, where: str = "after") -> np.ndarray:
    """``uint64[D + 1]`` document offsets of a stream split at ``eos_id``.

    ``where="after"``: a document ends with each EOS (nanoGPT); ``"before"``: a document starts at each EOS
    (llm.c). ``eos_id=None``: the whole stream is one document.
    """
    n = tokens.shape[0]
    if eos_id is None or n == 0:
        cuts = np.empty(0, np.int64)
    else:
        pos = np.flatnonzero(tokens == eos_id)
        cuts = pos + 1 if where == "after" else pos
        cuts = cuts[(cuts > 0) & (cuts < n)]
    return np.concatenate([[0], cuts, [n]]).astype(np.uint64)


def _check_arguments(path, sources: list, eos_id, out_dtype, page_size, metadata,
                     call: str = "import_nanogpt(path, bin_path)") -> str:
    """Check the importers' shared arguments before any work; returns ``path`` as a str.

    The output comes first (``import_nanogpt(path, bin_path)``, like ``write_tokens(path, source)``). A call with
    the two swapped is refused instead of overwriting the source: the output must not be an existing file
    other than a pageset file, and a source must not be a pageset file."""
    path = check_output_path(path)
    for src in sources:
        if isinstance(src, bytes) or not isinstance(src, (str, os.PathLike)):
            raise TypeError(f"the source must be a path (str or os.PathLike), got {src!r}")
        if not os.path.isfile(src):
            raise FileNotFoundError(f"{os.fspath(src)}: no such file (the output comes first: {call})")
        if _is_pageset(src):
            raise ValueError(f"{os.fspath(src)} is a pageset file, not a source to import; the output comes first: "
                             "import_nanogpt(path, bin_path), import_llmc(path, bin_path), "
                             "import_megatron(path, prefix)")
    if os.path.isfile(path) and os.path.getsize(path) and not _is_pageset(path):
        raise ValueError(f"the output {path} exists and is not a pageset file: refusing to replace it (are the "
                         f"arguments swapped? the output comes first: {call}); remove it or choose another output "
                         "path")
    check_not_input(path, sources)
    if is_url(path):  # an object's first bytes, through fsspec (credentials from the environment)
        check_replaceable(path, call)
    check.integer("eos_id", eos_id, minimum=0, maximum=UINT32_MAX)
    check.choice("out_dtype", out_dtype, ("auto",) + C.TOKEN_DTYPES)
    if page_size is not None:
        _check_page_size(page_size)
    check.mapping("metadata", metadata, optional=True)
    check.json_metadata("metadata", metadata)
    return path


def _is_pageset(path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(C.MAGIC)) == C.MAGIC


def _write_stream(path, tokens: np.ndarray, offsets: np.ndarray, eos_id, source: str, dtype: str, page_size,
                  metadata, t0) -> TokenWriteResult:
    if tokens.shape[0] == 0:
        raise ValueError(f"{source}: the source holds no tokens")
    if tokens.dtype.kind == "f":
        raise ValueError(f"{source}: token files hold integers, the source dtype is {tokens.dtype}")
    lo = hi = None
    for s in range(0, tokens.shape[0], COPY_CHUNK):  # one pass for the range (the source may be a memmap)
        block = tokens[s : s + COPY_CHUNK]
        lo = int(block.min()) if lo is None else min(lo, int(block.min()))
        hi = int(block.max()) if hi is None else max(hi, int(block.max()))
    if lo < 0 or hi > UINT32_MAX:
        raise ValueError(f"{source}: token ids must be in [0, 2^32), found [{lo}, {hi}]")
    if eos_id is None or eos_id < 0 or eos_id > UINT32_MAX:
        raise ValueError(f"{source}: eos_id must be given as an int in [0, 2^32), got {eos_id!r}")
    final = dtype if dtype != "auto" else ("uint16" if max(hi, eos_id) <= UINT16_MAX else "uint32")
    if final == "uint16" and hi > UINT16_MAX:
        raise ValueError(f"{source}: token id {hi} does not fit dtype='uint16'; use 'uint32' or 'auto'")
    kwargs = {} if page_size is None else {"page_size": page_size}
    writer = TokenFileWriter(path, final, **kwargs)
    try:
        for s in range(0, tokens.shape[0], COPY_CHUNK):
            writer.write(tokens[s : s + COPY_CHUNK])
    except BaseException:
        writer.abort()
        raise
    info = {"eos_id": int(eos_id), "bos_id": None, "tokenizer": None, "source": source, "max_id": hi}
    return writer.finish(offsets, info, metadata, t0)


def import_nanogpt(path, bin_path, *, dtype="uint16", eos_id: int = 50256, out_dtype: str = "auto",
                   page_size: int | None = None, metadata: dict | None = None) -> TokenWriteResult:
    """Convert a nanoGPT headerless ``.bin`` (ids of ``dtype``, default uint16; EOT 50256 after each document)
    into a token file at ``path`` (the output first, like every pageset writer). Document boundaries: after
    each ``eos_id``. ``out_dtype``: "auto", "uint16" or "uint32"; ``page_size``: None (default) or a power of
    two in [4 KiB, 1 GiB]. Raises TypeError / ValueError (bad arguments or data), FileNotFoundError."""
    t0 = time.perf_counter()
    path = _check_arguments(path, [bin_path], eos_id, out_dtype, page_size, metadata)
    dt = np.dtype(check.dtype_name("dtype", dtype, ("uint16", "uint32", "int32", "int64"))).newbyteorder("<")
    size = os.path.getsize(bin_path)
    if size % dt.itemsize:
        raise ValueError(f"{bin_path}: {size} bytes is not a multiple of {dt.itemsize} ({dt.name}); wrong dtype?")
    tokens = np.memmap(bin_path, dtype=dt, mode="r") if size else np.empty(0, dt)
    offsets = boundaries_at_eos(tokens, eos_id, "after")
    return _write_stream(path, tokens, offsets, eos_id, f"nanogpt:{os.path.basename(bin_path)}", out_dtype,
                         page_size, metadata, t0)


def read_llmc_header(bin_path) -> tuple[np.dtype, int]:
    """``(token dtype, token count)`` from an llm.c ``.bin`` header; raises ValueError on a bad magic, version
    or a count that disagrees with the file size."""
    size = os.path.getsize(bin_path)
    if size < LLMC_HEADER_INTS * 4:
        raise ValueError(f"{bin_path}: {size} bytes, too short for the 1024-byte llm.c header")
    header = np.fromfile(bin_path, dtype="<i4", count=LLMC_HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    dt = LLMC_KINDS.get((magic, version))
    if dt is None:
        raise ValueError(f"{bin_path}: llm.c magic/version {magic}/{version} unknown; expected one of "
                         f"{sorted(LLMC_KINDS)} (20240522 is an eval file, not tokens)")
    if count < 0 or LLMC_HEADER_INTS * 4 + count * dt.itemsize != size:
        raise ValueError(f"{bin_path}: header says {count} tokens of {dt.itemsize} bytes, the file has "
                         f"{size - LLMC_HEADER_INTS * 4} bytes after the header")
    return dt, count


def import_llmc(path, bin_path, *, eos_id: int | None = None, out_dtype: str = "auto", page_size: int | None = None,
                metadata: dict | None = None) -> TokenWriteResult:
    """Convert an llm.c ``.bin`` into a token file at ``path`` (the output first). ``eos_id`` defaults to 50256
    (GPT-2, magic 20240520) or 128000 (Llama 3 ``<|begin_of_text|>``, magic 20240801); documents start at each
    ``eos_id`` (llm.c prepends it). Raises TypeError / ValueError (bad arguments, bad header),
    FileNotFoundError."""
    t0 = time.perf_counter()
    path = _check_arguments(path, [bin_path], 0 if eos_id is None else eos_id, out_dtype, page_size, metadata,
                            "import_llmc(path, bin_path)")
    dt, count = read_llmc_header(bin_path)
    if eos_id is None:
        eos_id = 50256 if dt.itemsize == 2 else 128000
    tokens = np.memmap(bin_path, dtype=dt, mode="r", offset=LLMC_HEADER_INTS * 4, shape=(count,)) if count \
        else np.empty(0, dt)
    offsets = boundaries_at_eos(tokens, eos_id, "before")
    return _write_stream(path, tokens, offsets, eos_id, f"llm.c:{os.path.basename(bin_path)}", out_dtype,
                         page_size, metadata, t0)


def read_megatron_index(idx_path) -> dict:
    """Parse a Megatron ``MMIDIDX`` ``.idx``: ``{"dtype", "sizes" int32[S], "pointers" int64[S], "doc_idx"
    int64[D + 1]}``. Raises ValueError on a bad magic, version, dtype code or sizes past the end of the file."""
    with open(idx_path, "rb") as f:
        data = f.read()
    head = struct.calcsize("<9sQBQQ")
    if len(data) < head or data[:9] != MEGATRON_MAGIC:
        raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index (magic {data[:9]!r})")
    _, version, code, n_seq, n_doc = struct.unpack_from("<9sQBQQ", data)
    if version != 1:
        raise ValueError(f"{idx_path}: MMIDIDX version {version} unknown (expected 1)")
    if code not in MEGATRON_DTYPES:
        raise ValueError(f"{idx_path}: dtype code {code} unknown (expected one of {sorted(MEGATRON_DTYPES)})")
    if head + n_seq * 12 + n_doc * 8 > len(data):
        raise ValueError(f"{idx_path}: {n_seq} sequences and {n_doc} document indices do not fit the file")
    sizes = np.frombuffer(data, "<i4", n_seq, head)
    pointers = np.frombuffer(data, "<i8", n_seq, head + n_seq * 4)
    doc_idx = np.frombuffer(data, "<i8", n_doc, head + n_seq * 12)
    return {"dtype": np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<"), "sizes": sizes, "pointers": pointers,
            "doc_idx": doc_idx}


def import_megatron(path, prefix, *, eos_id: int, out_dtype: str = "auto", page_size: int | None = None,
                    metadata: dict | None = None) -> TokenWriteResult:
    """Convert a Megatron IndexedDataset ``<prefix>.bin`` + ``<prefix>.idx`` into a token file at ``path`` (the
    output first; ``prefix`` may also be either file's name).

    Sequences are concatenated in index order; document ``i`` spans sequences ``doc_idx[i] .. doc_idx[i+1]``
    (Megatron's preprocess_data.py appends EOD to each document only with ``--append-eod``; the stream is kept
    as is either way). ``eos_id`` (the tokenizer's EOD) is recorded for the loader's document outputs. Raises
    TypeError / ValueError (bad arguments or index), FileNotFoundError.
    """
    t0 = time.perf_counter()
    if isinstance(prefix, bytes) or not isinstance(prefix, (str, os.PathLike)):
        raise TypeError(f"prefix must be a path (str or os.PathLike), got {prefix!r}")
    prefix = os.fspath(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    path = _check_arguments(path, [prefix + ".idx", prefix + ".bin"], eos_id, out_dtype, page_size, metadata,
                            "import_megatron(path, prefix)")
    idx = read_megatron_index(prefix + ".idx")
    dt, sizes, pointers, doc_idx = idx["dtype"], idx["sizes"], idx["pointers"], idx["doc_idx"]
    bin_size = os.path.getsize(prefix + ".bin")
    if sizes.size and (sizes.min() < 0 or pointers.min() < 0
                       or np.any(pointers + sizes.astype(np.int64) * dt.itemsize > bin_size)):
        raise ValueError(f"{prefix}.bin: a sequence lies outside the file ({bin_size} bytes)")
    n_seq = sizes.size
    if doc_idx.size < 1 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
        raise ValueError(f"{prefix}.idx: doc_idx must rise from 0 to the sequence count {n_seq}")
    raw = np.memmap(prefix + ".bin", dtype=dt, mode="r") if bin_size else np.empty(0, dt)
    starts = pointers // dt.itemsize
    seq_offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    contiguous = np.array_equal(starts, seq_offsets[:-1]) and not np.any(pointers % dt.itemsize)
    if contiguous:  # the usual layout: one zero-copy slice
        tokens = raw[: seq_offsets[-1]]
    else:
        tokens = np.concatenate([raw[s : s + n] for s, n in zip(starts, sizes, strict=True)]) if n_seq else np.empty(0, dt)
    offsets = seq_offsets[doc_idx].astype(np.uint64)
    return _write_stream(path, tokens, offsets, eos_id, f"megatron:{os.path.basename(prefix)}", out_dtype,
                         page_size, metadata, t0)
