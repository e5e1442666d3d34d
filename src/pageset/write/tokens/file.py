"""The token file (format 1.1): :class:`TokenFileWriter` writes the pages of ids, then the sections, the section
table and the header, and commits; :class:`TokenWriteResult` is what every token write returns."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import numpy as np

from ...format import constants as C
from ...format.checksum import ALGORITHM
from ...format.fields import Tokens
from ...format.schema import build_schema, canonical_json, parse_schema
from ..assemble import PageWriter
from ..output import Output
from ..tail import lineage, write_tail
from ..writer import _check_page_size


@dataclass(frozen=True)
class TokenWriteResult:
    """What a token writer wrote: ``path``, ``documents``, ``tokens`` (count, BOS/EOS included), ``dtype``
    (``"uint16"``/``"uint32"``), ``dataset_id`` (hex SHA-256), ``bytes`` (file size), ``seconds`` (wall time); for
    a many-file set ``path`` is the folder, the counts, id and bytes are the whole set's and ``members`` names the
    member files this call wrote. ``skipped``: the conversations ``on_error="skip"`` left out, where each came from
    (``"chat.jsonl:12"``, ``"chat.parquet: row 3"``, ``"conversation 5"``), in source order."""

    path: str
    documents: int
    tokens: int
    dtype: str
    dataset_id: str
    bytes: int
    seconds: float
    members: tuple = ()
    skipped: tuple = ()


class TokenFileWriter:
    """Writes one token file: ``write(ids)`` appends ids (any integer array, values already checked to fit
    ``dtype``) to the data area; ``finish(doc_offsets, info, user, t0)`` writes schema, page checksums,
    metadata and doc_offsets sections, the section table and the header, fsyncs and renames the temp file over
    ``path`` (or uploads it, for an fsspec URL; see :class:`pageset.write.output.Output`). ``abort()``
    removes the temp file. Nothing exists at ``path`` until ``finish`` succeeds. ``parts`` and ``min_size`` (bytes
    the file will hold at least) go to :class:`~pageset.write.output.Output`."""

    def __init__(self, path: str, dtype: str, page_size: int = C.DEFAULT_PAGE_SIZE,
                 storage_options: dict | None = None, policy=None, parts=None, min_size: int = 0):
        _check_page_size(page_size)
        if dtype not in C.TOKEN_DTYPES:
            raise ValueError(f"dtype must be one of {C.TOKEN_DTYPES}, got {dtype!r}")
        self.path, self.dtype, self.page_size = os.fspath(path), dtype, page_size
        self._le = np.dtype(dtype).newbyteorder("<")
        self.out = Output(self.path, storage_options, policy=policy, parts=parts, min_size=min_size)
        self.path = self.out.path
        self.f = self.out.f
        self.f.seek(C.DATA_OFFSET)
        self.pages = PageWriter(self.f, page_size)
        self.count = 0

    def write(self, ids: np.ndarray) -> None:
        arr = np.ascontiguousarray(ids, dtype=self._le)
        self.pages.write(arr)
        self.count += arr.size

    def abort(self) -> None:
        self.out.abort()

    def finish(self, doc_offsets: np.ndarray, info: dict, user: dict | None, t0: float,
               record_lineage: bool = True, loss_mask: np.ndarray | None = None,
               skipped: list | None = None) -> TokenWriteResult:
        """Write the tail and commit; ``record_lineage=False`` keeps only ``info["source"]`` (and the skipped
        conversations) in the lineage, so the file's bytes depend on its content only. ``loss_mask``:
        ``uint8[count]`` of 0/1 (1 = trained on), stored bit-packed in the ``loss_mask`` section with the
        ``loss_mask`` feature bit; ``info["loss_mask"]`` then describes it (formats/v1.md section 10.1).
        ``skipped``: ``[(number in the source, where, error)]`` of the conversations left out, recorded in the
        lineage as ``skipped`` (the numbers) and ``skipped_errors`` (``{"index", "where", "error"}``)."""
        try:
            return self._finish(np.asarray(doc_offsets, dtype="<u8"), info, user or {}, t0, record_lineage,
                                loss_mask, skipped or [])
        except BaseException:
            self.abort()
            raise

    def _finish(self, offsets, info, user, t0, record_lineage, loss_mask, skipped) -> TokenWriteResult:
        if offsets.size < 2 or offsets[0] != 0 or offsets[-1] != self.count or np.any(offsets[1:] < offsets[:-1]):
            raise ValueError(f"doc_offsets must be non-decreasing from 0 to {self.count} tokens")
        mask_bytes = None
        if loss_mask is not None:
            loss_mask = np.asarray(loss_mask)
            if loss_mask.shape != (self.count,) or (loss_mask.size and loss_mask.max() > 1):
                raise ValueError(f"loss_mask must be {self.count} values of 0 or 1, got shape {loss_mask.shape}")
            if not isinstance(info.get("loss_mask"), dict):
                raise ValueError("a loss_mask needs info['loss_mask'] (train_on, rule, template_sha256)")
            mask_bytes = np.packbits(loss_mask.astype(np.uint8), bitorder="little").tobytes()
        canonical_json(user)  # fail on non-JSON metadata before writing sections
        skip_log = {} if not skipped else {
            "skipped": [k for k, _, _ in skipped],
            "skipped_errors": [{"index": k, "where": w, "error": e} for k, w, e in skipped]}
        f = self.f
        data_length = self.pages.pos
        crcs = self.pages.finish()
        tokens_obj = dict(info, dtype=self.dtype, count=self.count, documents=int(offsets.size - 1))
        schema = build_schema({"tokens": Tokens(self.dtype)}, {}, {"page_size": self.page_size,
                                                                   "checksum": ALGORITHM})
        schema["tokens"] = tokens_obj
        parse_schema(schema)
        self.schema = schema
        schema_bytes = canonical_json(schema)
        index_bytes = b""  # a token file has no records
        crc_bytes = crcs.tobytes()
        offsets_bytes = offsets.tobytes()
        # The dataset id covers the schema (counts, dtype, tokenizer), the page CRCs (every token), the document
        # offsets and the loss mask: the same corpus, tokenizer and settings always give the same id.
        dataset_id = hashlib.sha256(schema_bytes + index_bytes + crc_bytes + offsets_bytes
                                    + (mask_bytes or b"")).digest()
        sections = [
            (C.SECTION_SCHEMA, C.SECTION_FLAG_REQUIRED, schema_bytes),
            (C.SECTION_INDEX, C.SECTION_FLAG_REQUIRED, index_bytes),
            (C.SECTION_PAGE_CHECKSUMS, 0, crc_bytes),
            (C.SECTION_METADATA, 0, canonical_json({"lineage": dict(lineage() if record_lineage else {},
                                                                   source=info.get("source"), **skip_log),
                                                    "user": user})),
            (C.SECTION_DOC_OFFSETS, C.SECTION_FLAG_REQUIRED, offsets_bytes),
        ]
        features = C.REQUIRED_TOKENS
        if mask_bytes is not None:
            sections.append((C.SECTION_LOSS_MASK, C.SECTION_FLAG_REQUIRED, mask_bytes))
            features |= C.REQUIRED_LOSS_MASK
        file_size = write_tail(f, page_size=self.page_size, data_length=data_length, page_count=len(crcs),
                               record_count=0, required_features=features, dataset_id=dataset_id,
                               sections=sections)
        self.out.commit()
        return TokenWriteResult(self.path, int(offsets.size - 1), self.count, self.dtype, dataset_id.hex(),
                                file_size, time.perf_counter() - t0, skipped=tuple(w for _, w, _ in skipped))
