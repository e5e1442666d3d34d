"""``write_tokens``: tokenize a text corpus once and pack it into a pageset token file (format 1.1).

The data area is one flat little-endian stream of token ids: uint16 iff the largest stored id is <= 65535, else
uint32. Every document is followed by ``eos_id``; ``bos_id``, when given, is put before each document unless
the tokenizer already emitted it. The ``doc_offsets`` section holds the u64 token offset of every document start
(0 ... T). Pages are filled back to back (a window may straddle pages; tokens need no record alignment).

Encoding runs in worker processes, chunk by chunk, results consumed in order, so the file's bytes depend on the
input only. ``TOKENIZERS_PARALLELISM=false`` is set in each worker before it encodes (HF tokenizers' own thread
pool would otherwise deadlock or oversubscribe after ``fork``), never in the calling process.

The package, by responsibility: :mod:`.stream` (``write_tokens``: checks, dispatch, the local stream),
:mod:`.file` (the token file writer), :mod:`.encoding` (worker encoding), :mod:`.executors` (shards on any
``concurrent.futures.Executor``: processes, Dask, Ray), :mod:`.set_members` (many-file sets) and :mod:`.ids`
(id limits, the "id does not fit" check and document offsets, written once for all of them).
"""

import numpy as np  # noqa: F401 (pageset.write.tokens.np, as before the split)

from ..documents import (  # noqa: F401 (public here too)
    Conversation,
    _file_documents,
    _source_files,
    iter_conversations,
    iter_documents,
)
from ..tokenizers import (  # noqa: F401 (public here too: pageset.write.tokens.load_tokenizer, ...)
    CL100K_PAT,
    CL100K_SPECIAL,
    EOS_NAMES,
    TokenizerSpec,
    find_eos,
    load_tokenizer,
)
from .encoding import SKIP_HINT  # noqa: F401
from .executors import tokenize_to_shard  # noqa: F401
from .file import TokenFileWriter, TokenWriteResult
from .ids import SPILL_CHUNK, UINT16_MAX, UINT32_MAX  # noqa: F401
from .set_members import member_cuts, write_token_member  # noqa: F401
from .stream import tokenize_only, write_tokens

# the public names keep the module they have always been documented under (help(), pageset's lazy facade)
for _obj in (write_tokens, tokenize_only, TokenWriteResult, TokenFileWriter):
    _obj.__module__ = __name__
del _obj
