"""Tokenizers wrapped for the token writers: HF ``tokenizers`` (``tokenizer.json``, GPT-2 BPE file pairs), tiktoken
(an ``Encoding`` or a cl100k ranks file) and plain callables, behind one :class:`TokenizerSpec`; the end-of-text id
each one goes by (:func:`find_eos`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

from ..format import arguments as check

# cl100k_base's pre-tokenizer regex and special tokens (public constants of tiktoken's openai_public).
CL100K_PAT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
              r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
CL100K_SPECIAL = {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                  "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}


# ---- tokenizers --------------------------------------------------------------------------------------------

# Names an end-of-text token goes by, looked up in this order when no eos_id is given: GPT-2 / tiktoken,
# SentencePiece models (Llama 1-2, T5, Mistral), Llama 3, Gemma.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


@dataclass
class TokenizerSpec:
    """A tokenizer wrapped for writing: ``encode_batch(texts) -> list[list[int]]``, ``decode(ids) -> str``,
    ``vocab_size`` (int or None), ``default_eos`` (int or None: see :func:`find_eos`), ``name``, ``kind``
    (``"hf"``, ``"tiktoken"``, ``"callable"``), ``files_sha256`` (hex SHA-256 of the files it was built from,
    or of its vocabulary), ``special_tokens`` ({name: id} of its special / added tokens, for error messages)."""

    obj: object
    kind: str
    name: str
    files_sha256: str | None
    vocab_size: int | None
    default_eos: int | None
    special_tokens: dict | None = None

    def encode_batch(self, texts: list[str]) -> list:
        if self.kind == "hf":
            return [e.ids for e in self.obj.encode_batch(texts)]
        if self.kind == "tiktoken":
            return self.obj.encode_ordinary_batch(texts, num_threads=1)
        return [self.obj(t) for t in texts]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self.obj.decode(ids, skip_special_tokens=False)
        if self.kind == "tiktoken":
            return self.obj.decode(ids)
        raise TypeError("a plain callable tokenizer cannot decode")

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "files_sha256": self.files_sha256}


def _sha256_files(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def load_tokenizer(tokenizer) -> TokenizerSpec:
    """Wrap ``tokenizer`` for :func:`write_tokens`.

    Accepted: an HF ``tokenizers.Tokenizer``; a path to a ``tokenizer.json``; a pair ``(vocab, merges)`` of
    GPT-2-style files (``encoder.json``/``vocab.json`` + ``vocab.bpe``/``merges.txt``, loaded as byte-level BPE:
    the same ids as tiktoken's gpt2); a ``tiktoken.Encoding``; a path to a ``cl100k_base*.tiktoken`` ranks file;
    a ``TokenizerSpec``; or a callable ``str -> list[int]``. Raises TypeError/ValueError/ImportError.
    """
    if isinstance(tokenizer, TokenizerSpec):
        return tokenizer
    if isinstance(tokenizer, (tuple, list)) and len(tokenizer) == 2:
        paths = list(map(os.fspath, tokenizer))
        return _loading(paths, lambda: _gpt2_files(*paths))
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if path.endswith(".tiktoken"):
            return _loading([path], lambda: _tiktoken_file(path))
        if os.path.basename(path) in ("encoder.json", "vocab.json"):
            raise ValueError(f"{path} is a GPT-2-style vocabulary: also give its merges file "
                             "(tokenizer=(vocab, merges), or --merges vocab.bpe on the command line)")
        from tokenizers import Tokenizer

        tok = _loading([path], lambda: Tokenizer.from_file(path))
        return _hf(tok, os.path.basename(path), _sha256_files([path]))
    mod = type(tokenizer).__module__ or ""
    if mod.startswith("tokenizers"):
        digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        return _hf(tokenizer, "tokenizers.Tokenizer", digest)
    if mod.startswith("tiktoken"):
        return _tiktoken(tokenizer, tokenizer.name, _tiktoken_digest(tokenizer))
    if callable(tokenizer):
        own = next((getattr(tokenizer, a) for a in ("eos_token_id", "eos_id")
                    if check.is_int(getattr(tokenizer, a, None))), None)
        return TokenizerSpec(tokenizer, "callable", getattr(tokenizer, "__name__", type(tokenizer).__name__), None,
                             None, find_eos(lambda name: None, own), {})
    raise TypeError(f"tokenizer must be a tokenizer.json path, a (vocab, merges) pair of GPT-2 files "
                    f"(encoder.json, vocab.bpe), a *.tiktoken ranks path, a tokenizers.Tokenizer, a tiktoken "
                    f"Encoding, a callable str -> list[int], or None for pre-tokenized documents; got "
                    f"{tokenizer!r} ({type(tokenizer).__name__})")


def _loading(paths: list[str], load):
    """Run ``load()``; turn the bare Exceptions HF tokenizers raises from Rust into a ValueError naming the files."""
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"tokenizer file {p}: no such file")
    try:
        return load()
    except (ValueError, TypeError, ImportError):
        raise
    except Exception as exc:  # tokenizers raises plain Exception("expected ',' or '}' ...")
        raise ValueError(f"could not load the tokenizer from {', '.join(paths)}: {exc}") from exc


def find_eos(lookup, own=None) -> int | None:
    """The end-of-text id: the tokenizer's own EOS attribute (``own``) if it has one, else the first of
    ``EOS_NAMES`` that ``lookup(name)`` finds (``None`` when absent), else ``None``."""
    if own is not None:
        return int(own)
    for name in EOS_NAMES:
        found = lookup(name)
        if found is not None:
            return int(found)
    return None


SPECIAL_SHAPE = re.compile(r"<\|[^|\s]+\|>|</?s>|<(unk|pad|eos|bos|mask|sep|cls)>|\[[A-Z]+\]")


def _special_looking(vocab: dict) -> dict:
    """{token: id} of vocabulary entries shaped like special tokens (``<|...|>``, ``</s>``, ``<unk>``, ``[CLS]``)
    for a tokenizer that declares no added tokens (a GPT-2 BPE pair keeps ``<|endoftext|>`` in its vocabulary)."""
    return {t: i for t, i in vocab.items() if SPECIAL_SHAPE.fullmatch(t)}


def _hf(tok, name, digest) -> TokenizerSpec:
    added = {str(t): int(i) for i, t in tok.get_added_tokens_decoder().items()}
    specials = added or dict(sorted(_special_looking(tok.get_vocab(with_added_tokens=True)).items(),
                                    key=lambda kv: kv[1]))
    eos = find_eos(tok.token_to_id)
    return TokenizerSpec(tok, "hf", name, digest, tok.get_vocab_size(with_added_tokens=True), eos, specials)


def _gpt2_files(vocab: str, merges: str) -> TokenizerSpec:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    name = f"bpe:{os.path.basename(vocab)}+{os.path.basename(merges)}"
    return _hf(tok, name, _sha256_files([vocab, merges]))


def _tiktoken(enc, name, digest) -> TokenizerSpec:
    specials = {t: enc.encode_single_token(t) for t in sorted(enc.special_tokens_set)}
    # tiktoken's eot_token property is the id of "<|endoftext|>" (a KeyError when the Encoding has none), so the
    # names cover it without touching a property that can raise.
    eos = find_eos(specials.get)
    return TokenizerSpec(enc, "tiktoken", name, digest, enc.n_vocab, eos, specials)


def _tiktoken_digest(enc) -> str:
    ranks = getattr(enc, "_mergeable_ranks", {})
    h = hashlib.sha256(json.dumps([enc.name, getattr(enc, "_pat_str", ""), enc._special_tokens]).encode())
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little") + token)
    return h.hexdigest()


def _tiktoken_file(path: str) -> TokenizerSpec:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    base = os.path.basename(path)
    if not base.startswith("cl100k_base"):
        raise ValueError(f"{path}: only cl100k_base ranks files are known by name; pass a tiktoken.Encoding instead")
    enc = tiktoken.Encoding(name="cl100k_base", pat_str=CL100K_PAT, mergeable_ranks=load_tiktoken_bpe(path),
                            special_tokens=CL100K_SPECIAL)
    return _tiktoken(enc, "cl100k_base", _sha256_files([path]))
