"""Numbers of file format v1. ``formats/v1.md`` is the source of truth; ``tests/test_spec.py`` parses its
tables and compares them with this module, so the two cannot drift."""

from __future__ import annotations

# PNG-style magic: a high byte (catches 7-bit transfers), letters, CR LF (catches newline translation),
# ^Z (stops `type` on DOS), LF (catches LF -> CR LF).
MAGIC = b"\x89PGS\r\n\x1a\n"

FORMAT_MAJOR = 1
# 1.1 adds token streams (required feature bit REQUIRED_TOKENS, section kind 5). A 1.1 reader reads 1.0 files.
FORMAT_MINOR = 1

HEADER_SIZE = 160
# Pages start at the first 4 KiB boundary after the header: aligned for mmap and O_DIRECT-style reads.
DATA_ALIGN = 4096
DATA_OFFSET = 4096
# Sections after the data area start on 8-byte boundaries so their arrays are naturally aligned.
SECTION_ALIGN = 8

MIN_PAGE_SIZE = 4096
MAX_PAGE_SIZE = 1 << 30
# 8 MiB: ~100-200 ImageNet JPEGs at max side 512, or 4M uint16 tokens; a page is the unit of prefetch and
# of quasi-random shuffling, so bigger pages mean fewer seeks and coarser locality.
DEFAULT_PAGE_SIZE = 8 << 20

# Section kinds (section table entry field `kind`).
SECTION_SCHEMA = 1
SECTION_INDEX = 2
SECTION_PAGE_CHECKSUMS = 3
SECTION_METADATA = 4
SECTION_DOC_OFFSETS = 5  # token files (1.1): <u8[D + 1] token offsets of document starts, 0 ... token count
SECTION_LOSS_MASK = 6  # token files with REQUIRED_LOSS_MASK: ceil(count / 8) bytes, one bit per token, LSB first
SECTION_NAMES = {
    SECTION_SCHEMA: "schema",
    SECTION_INDEX: "index",
    SECTION_PAGE_CHECKSUMS: "page_checksums",
    SECTION_METADATA: "metadata",
    SECTION_DOC_OFFSETS: "doc_offsets",
    SECTION_LOSS_MASK: "loss_mask",
}
# Section flags: a reader that meets an unknown kind with this flag set MUST refuse the file.
SECTION_FLAG_REQUIRED = 1

# Feature bits. A reader MUST refuse a file with any required bit it does not know, and MUST ignore unknown
# optional bits. v1.0 defined no required feature; v1.1 adds REQUIRED_TOKENS, so a 1.0 reader refuses a token
# file cleanly (UnsupportedFeatureError) instead of misreading its empty index as an empty dataset.
REQUIRED_TOKENS = 1 << 0
# A token file with a per-token loss mask (chat / SFT data, section 10.1): a reader without it refuses the file
# (UnsupportedFeatureError) instead of training on every token.
REQUIRED_LOSS_MASK = 1 << 1
KNOWN_REQUIRED_FEATURES = REQUIRED_TOKENS | REQUIRED_LOSS_MASK
OPTIONAL_PAGE_CHECKSUMS = 1 << 0
KNOWN_OPTIONAL_FEATURES = OPTIONAL_PAGE_CHECKSUMS

# Image encodings (index column `<field>.encoding`).
ENCODING_RAW = 0  # HWC uint8 RGB, row-major, height*width*3 bytes
ENCODING_JPEG = 1  # a baseline or progressive JFIF JPEG
ENCODING_NAMES = {ENCODING_RAW: "raw", ENCODING_JPEG: "jpeg"}

# Field kinds and the dtypes each accepts (numpy dtype names; stored little-endian).
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool")
FLOAT_DTYPES = ("float16", "float32", "float64")
NDARRAY_DTYPES = INT_DTYPES + FLOAT_DTYPES
# Token streams: uint16 iff the largest stored id is <= 65535, else uint32 (stored little-endian).
TOKEN_DTYPES = ("uint16", "uint32")

# Limits that keep a malicious or broken file from asking for absurd allocations.
MAX_FIELD_NAME_BYTES = 255
MAX_FIELDS = 1024
MAX_SCHEMA_BYTES = 16 << 20
