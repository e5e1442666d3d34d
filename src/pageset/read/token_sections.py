"""The token-file checks of ``formats/v1.md`` section 10, run by :class:`~pageset.read.reader.Dataset` at open for
any file with the ``tokens`` feature bit or field: schema, geometry and the ``doc_offsets`` section. On their own
here (format imports only) so that the reader and :mod:`pageset.read.tokens` both import them one way."""

from __future__ import annotations

import numpy as np

from ..format import constants as C
from ..format.errors import FormatError, SchemaError

DOC_OFFSET = np.dtype("<u8")


def validate_loss_mask(ds, sections: dict, info: dict, count: int) -> np.ndarray | None:
    """The ``loss_mask`` section (formats/v1.md section 10.1) as read-only ``uint8[ceil(count / 8)]`` (bit ``t % 8``
    of byte ``t // 8`` is token ``t``'s mask), or None for a file without the ``loss_mask`` feature bit. Raises
    SchemaError / FormatError naming the path and section: a mask that does not match the tokens (its length,
    set bits past the last token), a section without the feature bit or the reverse, no ``tokens.loss_mask``."""
    has_bit = bool(int(ds.header["required_features"]) & C.REQUIRED_LOSS_MASK)
    if not has_bit:
        if C.SECTION_LOSS_MASK in sections:
            raise ds._err(FormatError, "loss_mask", sections[C.SECTION_LOSS_MASK][0],
                          "a loss_mask section without the required 'loss_mask' feature bit")
        return None
    schema_off = sections[C.SECTION_SCHEMA][0]
    described = info.get("loss_mask")
    if not isinstance(described, dict) or not isinstance(described.get("train_on"), list):
        raise ds._err(SchemaError, "schema", schema_off,
                      "a file with the 'loss_mask' feature needs a \"tokens\".\"loss_mask\" object with train_on")
    if C.SECTION_LOSS_MASK not in sections:
        raise ds._err(FormatError, "loss_mask", None, "required section is missing (the 'loss_mask' feature bit is set)")
    off, payload = sections[C.SECTION_LOSS_MASK]
    want = -(-count // 8)
    if len(payload) != want:
        raise ds._err(FormatError, "loss_mask", off, f"section is {len(payload)} bytes, but {count} tokens need "
                      f"ceil({count} / 8) = {want}: the mask does not match the token stream")
    mask = np.frombuffer(payload, dtype=np.uint8)
    if count % 8 and int(mask[-1]) >> (count % 8):
        raise ds._err(FormatError, "loss_mask", off + want - 1,
                      f"bits past the last token ({count}) are set; they must be zero")
    return mask


def validate_token_sections(ds, sections: dict) -> tuple[dict, np.ndarray]:
    """Check a token file's schema, geometry and ``doc_offsets`` section (already CRC-checked by the reader);
    ``ds`` is the :class:`~pageset.read.reader.Dataset` being opened.

    Returns ``(tokens_info, doc_offsets)``: the schema's ``"tokens"`` object and a read-only ``<u8[D + 1]``
    view of the section. Raises :class:`SchemaError` or :class:`FormatError` naming the path, section and
    byte offset.
    """
    schema_off = sections[C.SECTION_SCHEMA][0]
    if not int(ds.header["required_features"]) & C.REQUIRED_TOKENS:
        raise ds._err(SchemaError, "schema", schema_off, "a tokens field needs the required 'tokens' feature bit")
    fields = list(ds.fields.values())
    if len(fields) != 1 or fields[0].kind != "tokens":
        raise ds._err(SchemaError, "schema", schema_off, "a token file has exactly one field, of kind 'tokens'")
    info = ds.schema.get("tokens")
    keys = ("count", "documents", "dtype", "eos_id")
    if not isinstance(info, dict) or any(k not in info for k in keys):
        raise ds._err(SchemaError, "schema", schema_off, f"token file schema needs a \"tokens\" object with {keys}")
    count, docs, dtype = info["count"], info["documents"], info["dtype"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (count, docs)):
        raise ds._err(SchemaError, "schema", schema_off, "tokens.count and tokens.documents must be ints >= 0")
    if dtype not in C.TOKEN_DTYPES or dtype != fields[0].dtype:
        raise ds._err(SchemaError, "schema", schema_off, f"tokens.dtype {dtype!r} must equal the field's dtype")
    # eos_id / bos_id are used as ints by TokenDataset and the loader's document outputs: a forged schema with
    # a list, a float or an id outside the dtype must be a SchemaError, not a TypeError later (found by
    # tools/fuzz.py: "bos_id": [2**40, 2**40] raised TypeError in TokenDataset.__init__).
    id_max = int(np.iinfo(np.dtype(dtype)).max)
    for key in ("eos_id", "bos_id"):
        v = info.get(key)
        if v is None and key == "bos_id":
            continue
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= id_max:
            raise ds._err(SchemaError, "schema", schema_off, f"tokens.{key} must be an int in [0, {id_max}], got {v!r}")
    if ds.record_count != 0:
        raise ds._err(FormatError, "header", 40, f"a token file has record_count 0, got {ds.record_count}")
    itemsize = np.dtype(dtype).itemsize
    if ds.data_length != count * itemsize:
        raise ds._err(FormatError, "header", 56,
                      f"data_length {ds.data_length} != {count} tokens x {itemsize} bytes ({dtype})")
    if C.SECTION_DOC_OFFSETS not in sections:
        raise ds._err(FormatError, "doc_offsets", None, "required section is missing from a token file")
    off, payload = sections[C.SECTION_DOC_OFFSETS]
    if len(payload) != (docs + 1) * DOC_OFFSET.itemsize:
        raise ds._err(FormatError, "doc_offsets", off,
                      f"section is {len(payload)} bytes, expected ({docs} documents + 1) x 8")
    offsets = np.frombuffer(payload, dtype=DOC_OFFSET)
    if offsets[0] != 0 or offsets[-1] != count:
        raise ds._err(FormatError, "doc_offsets", off,
                      f"offsets must run from 0 to {count}, got {int(offsets[0])} ... {int(offsets[-1])}")
    bad = np.flatnonzero(offsets[1:] < offsets[:-1])
    if bad.size:
        i = int(bad[0])
        raise ds._err(FormatError, "doc_offsets", off + (i + 1) * 8, f"offset of document {i + 1} decreases")
    return info, offsets
