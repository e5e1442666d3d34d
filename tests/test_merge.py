"""merge_datasets / pageset merge: concatenating finished files gives the bytes of writing the whole source."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pageset import (
    Int,
    NDArray,
    RGBImage,
    merge_datasets,
    open_dataset,
    open_tokens,
    write_dataset,
    write_tokens,
)
from pageset.cli import main


class Rows:
    """An indexable source of (image path, label, vector) rows; a row whose path is None is bad."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, label = self.rows[i]
        if path is None:
            raise OSError(f"row {label} is unreadable")
        return path, label, np.full(3, label, dtype=np.float32)


FIELDS = {"image": RGBImage(max_resolution=96), "label": Int(), "vec": NDArray("float32", (3,))}


def _rows(photos, n):
    return [(photos[i % len(photos)], i) for i in range(n)]


def test_merge_records_equals_writing_the_whole_source(tmp_path, photos):
    rows = _rows(photos, 14)
    rows[3] = (None, 3)   # skipped in part A
    rows[11] = (None, 11)  # skipped in part C, index 1 there
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 14, "on_error": "skip"}
    whole = write_dataset(tmp_path / "whole.pageset", Rows(rows), FIELDS, **kw)
    parts = []
    for k, (a, b) in enumerate([(0, 6), (6, 10), (10, 14)]):
        parts.append(tmp_path / f"p{k}.pageset")
        write_dataset(parts[-1], Rows(rows[a:b]), FIELDS, **kw)
    res = merge_datasets(tmp_path / "merged.pageset", parts, progress=False, lineage=False)
    assert res.skipped == whole.skipped == (3, 11) and res.records == 12
    assert res.dataset_id == whole.dataset_id
    assert (tmp_path / "merged.pageset").read_bytes() == (tmp_path / "whole.pageset").read_bytes()
    with open_dataset(tmp_path / "merged.pageset") as ds:
        ds.verify()
        assert ds.index["label"].tolist() == [i for i in range(14) if i not in (3, 11)]
    # another page size re-places the records: same records, other bytes
    merge_datasets(tmp_path / "big.pageset", parts, progress=False, page_size=1 << 16)
    with open_dataset(tmp_path / "big.pageset") as a, open_dataset(tmp_path / "merged.pageset") as b:
        assert a.page_size == 1 << 16 and len(a) == len(b)
        for i in (0, 5, 11):
            assert a[i]["image"].data == b[i]["image"].data and a[i]["label"] == b[i]["label"]


def test_merge_imagefolders_same_classes(tmp_path, imagenet_like):
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 15}
    fields = {"image": RGBImage(max_resolution=64), "label": Int()}
    write_dataset(tmp_path / "a.pageset", imagenet_like, fields, **kw)
    res = merge_datasets(tmp_path / "m.pageset", [tmp_path / "a.pageset"] * 2, progress=False, lineage=False)
    with open_dataset(tmp_path / "m.pageset") as m, open_dataset(tmp_path / "a.pageset") as a:
        assert res.records == 2 * len(a)
        assert m.schema["attributes"]["class_names"] == a.schema["attributes"]["class_names"]
        assert m.index["label"].tolist() == a.index["label"].tolist() * 2
        assert m.metadata["lineage"]["samples_in_source"] == 2 * len(a)


def test_merge_refuses_other_schema_naming_the_difference(tmp_path, photos, imagenet_like):
    kw = {"num_workers": 0, "progress": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "a.pageset", Rows(_rows(photos, 3)), FIELDS, **kw)
    other = dict(FIELDS, image=RGBImage(max_resolution=64))
    write_dataset(tmp_path / "b.pageset", Rows(_rows(photos, 3)), other, **kw)
    with pytest.raises(ValueError, match=r"b\.pageset: field 0 is 'image' \(rgb_image .*max_resolution.: 64"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "a.pageset", tmp_path / "b.pageset"], progress=False)
    # class lists: same classes renamed
    renamed = tmp_path / "renamed"
    import shutil

    shutil.copytree(imagenet_like, renamed)
    first = sorted(p.name for p in renamed.iterdir())[0]
    (renamed / first).rename(renamed / ("a_" + first))
    fields = {"image": RGBImage(max_resolution=32), "label": Int()}
    write_dataset(tmp_path / "c.pageset", imagenet_like, fields, **kw)
    write_dataset(tmp_path / "d.pageset", renamed, fields, **kw)
    with pytest.raises(ValueError, match=rf"d\.pageset: class list differs .* at label 0: 'a_{first}' vs '{first}'"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "c.pageset", tmp_path / "d.pageset"], progress=False)
    write_tokens(tmp_path / "t.pageset", [np.arange(5)], None, eos_id=0, num_workers=0, progress=False)
    with pytest.raises(ValueError, match=r"cannot merge token files with record files \(.*t\.pageset is a token "
                                         r"file, .*a\.pageset is not\)"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "a.pageset", tmp_path / "t.pageset"], progress=False)
    with pytest.raises(ValueError, match="is the input"):
        merge_datasets(tmp_path / "a.pageset", [tmp_path / "a.pageset", tmp_path / "a.pageset"], progress=False)
    assert not (tmp_path / "m.pageset").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_merge_tokens_shifts_offsets_and_widens(tmp_path):
    rng = np.random.default_rng(0)
    small = [rng.integers(2, 60000, size=int(rng.integers(1, 40))) for _ in range(30)]
    large = [rng.integers(2, 200000, size=int(rng.integers(1, 40))) for _ in range(20)]
    kw = {"eos_id": 1, "num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 12}
    a = write_tokens(tmp_path / "a", small, None, **kw)
    b = write_tokens(tmp_path / "b", large, None, **kw)
    whole = write_tokens(tmp_path / "whole", small + large, None, **kw)
    assert (a.dtype, b.dtype, whole.dtype) == ("uint16", "uint32", "uint32")
    res = merge_datasets(tmp_path / "m", [tmp_path / "a", tmp_path / "b"], progress=False, lineage=False)
    assert (res.dtype, res.documents, res.tokens) == ("uint32", 50, a.tokens + b.tokens)
    assert (tmp_path / "m").read_bytes() == (tmp_path / "whole").read_bytes()
    with open_tokens(tmp_path / "m") as td:
        assert td.document(30)[:-1].tolist() == large[0].tolist()
        assert int(td.doc_offsets[30]) == a.tokens
    # same-dtype parts of one text corpus
    parts = [[np.arange(1, 9) + k for k in range(s, s + 5)] for s in (0, 5)]
    for k, p in enumerate(parts):
        write_tokens(tmp_path / f"t{k}", p, None, **kw)
    write_tokens(tmp_path / "tw", parts[0] + parts[1], None, **kw)
    assert main(["merge", str(tmp_path / "tm"), str(tmp_path / "t0"), str(tmp_path / "t1"), "--no-progress"]) == 0
    with open_tokens(tmp_path / "tm") as m, open_tokens(tmp_path / "tw") as w:
        assert m.dataset_id == w.dataset_id and m.dtype == np.dtype("<u2")
    write_tokens(tmp_path / "other_eos", small, None, **dict(kw, eos_id=0))
    with pytest.raises(ValueError, match="token setting 'eos_id' is 0"):
        merge_datasets(tmp_path / "x", [tmp_path / "a", tmp_path / "other_eos"], progress=False)


def test_cli_merge_records(tmp_path, photos, capsys):
    kw = {"num_workers": 0, "progress": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "a.pageset", Rows(_rows(photos, 3)), FIELDS, **kw)
    write_dataset(tmp_path / "b.pageset", Rows(_rows(photos, 4)), FIELDS, **kw)
    assert main(["merge", str(tmp_path / "m.pageset"), str(tmp_path / "a.pageset"), str(tmp_path / "b.pageset"),
                 "--no-progress"]) == 0
    assert "7 records from 2 files" in capsys.readouterr().out
    write_dataset(tmp_path / "c.pageset", Rows(_rows(photos, 2)), dict(FIELDS, label=Int("int16")), **kw)
    assert main(["merge", str(tmp_path / "n.pageset"), str(tmp_path / "a.pageset"), str(tmp_path / "c.pageset"),
                 "--no-progress"]) == 1
    assert "field 1 is 'label'" in capsys.readouterr().err


def test_merge_refuses_a_damaged_input(tmp_path, photos):
    kw = {"num_workers": 0, "progress": False, "page_size": 1 << 12}
    write_dataset(tmp_path / "a.pageset", Rows(_rows(photos, 3)), FIELDS, **kw)
    write_dataset(tmp_path / "b.pageset", Rows(_rows(photos, 3)), FIELDS, **kw)
    raw = bytearray((tmp_path / "b.pageset").read_bytes())
    raw[4096 + 5000] ^= 0x10  # a bit flip inside page 1 of the data area
    (tmp_path / "b.pageset").write_bytes(bytes(raw))
    from pageset import ChecksumMismatchError

    with pytest.raises(ChecksumMismatchError, match="page 1 CRC-32"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "a.pageset", tmp_path / "b.pageset"], progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pageset", "b.pageset"]


class OtherRows(Rows):
    """The same rows under another source class: the writer names the source ``source OtherRows``."""


def test_merge_lineage_names_both_sources_and_shifts_skips_past_the_error_log(tmp_path, photos, capsys):
    # the merged lineage (formats/v1.md, metadata `lineage`): `source` joins the inputs' descriptions with " + "
    # when they differ (the writer describes a custom source as "source <class name>"); `skipped` holds every
    # skipped index shifted by the samples before it, also those past an input's 1,000-entry `skipped_errors` log
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 12, "on_error": "skip"}
    ints = {"label": Int()}

    class Labels:
        def __init__(self, n, bad):
            self.n, self.bad = n, bad

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            if i in self.bad:
                raise OSError(f"row {i} is unreadable")
            return (i,)

    write_dataset(tmp_path / "a.pageset", Labels(1003, set(range(1001))), ints, **kw)  # 1001 skipped, 2 kept
    write_dataset(tmp_path / "b.pageset", Labels(3, {1}), ints, **kw)
    with open_dataset(tmp_path / "a.pageset") as a:
        lin = a.metadata["lineage"]
        assert len(lin["skipped"]) == 1001 and len(lin["skipped_errors"]) == 1000  # the log is capped
    capsys.readouterr()
    before = time.perf_counter()
    res = merge_datasets(tmp_path / "m.pageset", [tmp_path / "a.pageset", tmp_path / "b.pageset"], progress=False,
                         lineage=False, metadata={"split": "train"})
    took = time.perf_counter() - before
    assert res.skipped == tuple(range(1001)) + (1004,) and res.records == 4
    assert 0 <= res.seconds <= took  # the merge's own wall time (a consistency bound, not a speed claim)
    assert capsys.readouterr().err == ""  # progress=False: no bar
    with open_dataset(tmp_path / "m.pageset") as m:
        assert m.metadata["user"] == {"split": "train"}
        assert m.index["label"].tolist() == [1001, 1002, 0, 2]
        assert m.metadata["lineage"]["samples_in_source"] == 1006
        assert m.metadata["lineage"]["source"] == "source Labels"
    # two different sources: both named, in input order
    write_dataset(tmp_path / "r.pageset", Rows(_rows(photos, 2)), FIELDS, **kw)
    write_dataset(tmp_path / "o.pageset", OtherRows(_rows(photos, 2)), FIELDS, **kw)
    merge_datasets(tmp_path / "ro.pageset", [tmp_path / "r.pageset", tmp_path / "o.pageset"], progress=False)
    with open_dataset(tmp_path / "ro.pageset") as ro:
        assert ro.metadata["lineage"]["source"] == "source Rows + source OtherRows"


def test_merge_refusals_name_the_missing_field_the_token_setting_and_the_damage(tmp_path, photos):
    kw = {"num_workers": 0, "progress": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "a.pageset", Rows(_rows(photos, 2)), FIELDS, **kw)

    class Wider(Rows):
        def __getitem__(self, i):
            return (*super().__getitem__(i), i)

    write_dataset(tmp_path / "b.pageset", Wider(_rows(photos, 2)), dict(FIELDS, extra=Int()), **kw)
    with pytest.raises(ValueError, match=r"b\.pageset: field 3 is 'extra' \(int .*\), but .*a\.pageset has no field "
                                         r"there; merge needs the same fields"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "a.pageset", tmp_path / "b.pageset"], progress=False)
    tk = {"eos_id": 1, "num_workers": 0, "progress": False}
    write_tokens(tmp_path / "t1", [np.arange(2, 9)], None, **tk)
    write_tokens(tmp_path / "t2", [np.arange(2, 9)], None, bos_id=0, **tk)
    with pytest.raises(ValueError, match=r"t2: token setting 'bos_id' is 0, but .*t1 has None"):
        merge_datasets(tmp_path / "x", [tmp_path / "t1", tmp_path / "t2"], progress=False)
    raw = bytearray((tmp_path / "a.pageset").read_bytes())
    raw[4096 + 100] ^= 0x01  # a bit flip in page 0 of the data area
    (tmp_path / "a.pageset").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"page 0 CRC-32 .*the input is damaged: nothing was merged$"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "a.pageset"] * 2, progress=False)
    assert not (tmp_path / "m.pageset").exists() and not (tmp_path / "x").exists()


def test_merge_sums_ignored_files_and_keeps_user_metadata_only_when_inputs_agree(tmp_path, imagenet_like):
    import shutil

    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 15}
    fields = {"image": RGBImage(max_resolution=32), "label": Int()}
    root = tmp_path / "folder"
    shutil.copytree(imagenet_like, root)
    first = sorted(p for p in root.iterdir() if p.is_dir())[0]
    (first / "notes.txt").write_text("not an image")  # one ignored file per input (schema attributes.ignored_files)
    write_dataset(tmp_path / "a.pageset", root, fields, metadata={"k": 1}, **kw)
    write_dataset(tmp_path / "b.pageset", root, fields, metadata={"k": 1}, **kw)
    write_dataset(tmp_path / "c.pageset", root, fields, metadata={"k": 2}, **kw)
    ab, ac = tmp_path / "ab.pageset", tmp_path / "ac.pageset"
    merge_datasets(ab, [tmp_path / "a.pageset", tmp_path / "b.pageset"], progress=False, lineage=False)
    merge_datasets(ac, [tmp_path / "a.pageset", tmp_path / "c.pageset"], progress=False, lineage=False)
    merge_datasets(tmp_path / "one.pageset", [tmp_path / "a.pageset"], progress=False, lineage=False)  # one input
    with open_dataset(ab) as m, open_dataset(ac) as n, open_dataset(tmp_path / "one.pageset") as one:
        assert one.metadata["user"] == {"k": 1} and one.schema["attributes"]["ignored_files"] == 1
        assert m.schema["attributes"]["ignored_files"] == 2
        assert m.metadata["user"] == {"k": 1}  # the inputs agree: kept
        assert n.metadata["user"] == {}  # they differ: none
    (tmp_path / "junk.bin").write_bytes(b"not a pageset file")
    with pytest.raises(ValueError, match=r"junk\.bin exists and is not a pageset file: .*the order is "
                                         r"merge_datasets\(path, \[a, b, \.\.\.\]\)"):
        merge_datasets(tmp_path / "junk.bin", [tmp_path / "a.pageset", tmp_path / "b.pageset"], progress=False)


# -- issue 28 item 5: a many-file set's folder as an input

def _member_paths(folder) -> list[str]:
    """The member files of the set at ``folder``, in manifest order, read from the manifest JSON itself."""
    import json

    manifest = json.loads((folder / "pageset.manifest.json").read_text())
    return [str(folder / e["name"]) for e in manifest["members"]]


def test_merge_takes_a_many_file_set_as_its_members_in_manifest_order(tmp_path, photos, capsys):
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "set", Rows(_rows(photos, 11)), FIELDS, records_per_member=4, **kw)
    write_dataset(tmp_path / "one.pageset", Rows(_rows(photos, 11)), FIELDS, **kw)
    write_dataset(tmp_path / "b.pageset", Rows(_rows(photos, 3)), FIELDS, **kw)
    members = _member_paths(tmp_path / "set")
    assert len(members) == 3
    res = merge_datasets(tmp_path / "m.pageset", [tmp_path / "set"], progress=False, lineage=False)
    assert res.records == 11
    # the README's promise: merging a set's members gives the single file of the whole source, byte for byte
    assert (tmp_path / "m.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()
    # a set among files, named by its folder or its manifest: exactly the merge of the member files in its place
    merge_datasets(tmp_path / "want.pageset", [tmp_path / "b.pageset", *members, tmp_path / "b.pageset"],
                   progress=False, lineage=False)
    for name in ("set", "set/pageset.manifest.json"):
        merge_datasets(tmp_path / "mix.pageset", [tmp_path / "b.pageset", tmp_path / name, tmp_path / "b.pageset"],
                       progress=False, lineage=False)
        assert (tmp_path / "mix.pageset").read_bytes() == (tmp_path / "want.pageset").read_bytes()
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "cli.pageset"), str(tmp_path / "set"), str(tmp_path / "b.pageset"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "14 records from 1 file and 1 many-file set (3 members)" in out, out
    with open_dataset(tmp_path / "cli.pageset") as ds:
        assert ds.index["label"].tolist() == list(range(11)) + [0, 1, 2]


def test_merge_takes_a_token_set(tmp_path):
    rng = np.random.default_rng(5)
    docs = [rng.integers(2, 60000, size=int(rng.integers(1, 300))) for _ in range(40)]
    kw = {"eos_id": 1, "num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 12}
    write_tokens(tmp_path / "set", docs, None, docs_per_member=15, dtype="uint16", **kw)
    write_tokens(tmp_path / "one.pageset", docs, None, dtype="uint16", **kw)
    res = merge_datasets(tmp_path / "m.pageset", [tmp_path / "set"], progress=False, lineage=False)
    assert (res.documents, res.dtype) == (40, "uint16")
    assert (tmp_path / "m.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()


def test_merge_of_a_set_refuses_a_replaced_member_and_a_folder_without_manifest(tmp_path, photos, capsys):
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "set", Rows(_rows(photos, 9)), FIELDS, records_per_member=4, **kw)
    members = _member_paths(tmp_path / "set")
    # a member swapped for another valid pageset file (same schema) after the manifest was written
    write_dataset(tmp_path / "other.pageset", Rows(_rows(photos, 4)[::-1]), FIELDS, **kw)
    import shutil

    shutil.copyfile(tmp_path / "other.pageset", members[1])
    from pageset.format.errors import MemberMismatchError

    with pytest.raises(MemberMismatchError, match=r"m0001-000001\.pageset.*dataset id .*the manifest lists"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "set"], progress=False)
    assert not (tmp_path / "m.pageset").exists()
    # a folder that is no set: named, with the fix, and nothing written
    (tmp_path / "loose").mkdir()
    shutil.copyfile(tmp_path / "other.pageset", tmp_path / "loose" / "a.pageset")
    with pytest.raises(FileNotFoundError, match=r"loose is a folder without pageset\.manifest\.json.*give the "
                                                r"pageset files in it"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "loose"], progress=False)
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "m.pageset"), str(tmp_path / "loose"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "pageset merge: " in err and "Is a directory" not in err and "give the pageset files in it" in err, err
    assert not (tmp_path / "m.pageset").exists()
    # the output among the set's members is refused before any work
    with pytest.raises(ValueError, match="writing would destroy the source"):
        merge_datasets(members[0], [tmp_path / "set"], progress=False)


def test_merge_refuses_an_input_replaced_between_its_check_and_its_copy(tmp_path, photos, monkeypatch):
    """Inputs are checked in a first pass and copied in a second (one open at a time): a file replaced in between
    (here: a valid pageset file of the same schema renamed over it) is refused, not merged unchecked."""
    import os

    import pageset.merge as merge_mod
    from pageset.format.errors import FileChangedError

    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "set", Rows(_rows(photos, 6)), FIELDS, records_per_member=3, **kw)
    write_dataset(tmp_path / "other.pageset", Rows(_rows(photos, 3)[::-1]), FIELDS, **kw)
    members = _member_paths(tmp_path / "set")
    checked = merge_mod._open_inputs

    def then_replace(*args):
        opened = checked(*args)
        os.replace(tmp_path / "other.pageset", members[1])  # after the check, before the copy
        return opened

    monkeypatch.setattr(merge_mod, "_open_inputs", then_replace)
    with pytest.raises(FileChangedError, match=r"m0001-000001\.pageset: .*changed while it was merged"):
        merge_datasets(tmp_path / "m.pageset", [tmp_path / "set"], progress=False)
    assert not (tmp_path / "m.pageset").exists()


MERGE_UNDER_LIMIT = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from pageset import merge_datasets
r = merge_datasets(sys.argv[1], sys.argv[2:], progress=False, lineage=False)
print(r.records)
"""


def test_merge_of_a_set_of_many_members_stays_within_a_low_open_file_limit(tmp_path):
    import subprocess
    import sys

    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 12}
    rows = [{"label": i} for i in range(150)]
    write_dataset(tmp_path / "set", rows, {"label": Int()}, records_per_member=1, **kw)  # 150 members
    write_dataset(tmp_path / "one.pageset", rows, {"label": Int()}, **kw)
    # the set's folder, and its 150 member files named one by one (each input is open only while it is read)
    for inputs in ([str(tmp_path / "set")], _member_paths(tmp_path / "set")):
        r = subprocess.run([sys.executable, "-c", MERGE_UNDER_LIMIT, str(tmp_path / "m.pageset"), *inputs],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and r.stdout.strip() == "150", r.stderr[-2000:]
        assert (tmp_path / "m.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()


# -- issue 28 item 5: a pre-tokenized set stores the dtype the single file of the same input stores

def _set_dtypes(folder) -> set:
    """The stored token dtype of every member, read by the reference reader (tests/reference/format.py)."""
    from reference import format as ref_format

    return {ref_format.read_file(p).schema["tokens"]["dtype"] for p in _member_paths(folder)}


@pytest.mark.parametrize("high", [60_000, 65_535, 65_536, 200_000])
@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "generator"])
def test_pre_tokenized_set_members_merge_to_the_single_file(tmp_path, high, one_shot):
    """dtype="auto": uint16 iff the largest id (BOS/EOS included) fits, decided from the whole input for every
    member alike, as the single file decides; so merging the members gives the single file, byte for byte. The
    largest id sits in the last member only: a per-member choice would give members of two dtypes."""
    rng = np.random.default_rng(high)
    docs = [rng.integers(2, 50_000, size=int(rng.integers(1, 200))) for _ in range(30)]
    docs[-1][0] = high  # the largest id, in the last member
    kw = {"eos_id": 1, "progress": False, "lineage": False, "page_size": 1 << 12}
    one = write_tokens(tmp_path / "one.pageset", docs, None, num_workers=0, **kw)
    assert one.dtype == ("uint16" if high <= 65_535 else "uint32")  # the single file's documented rule
    for workers in (0, 2):
        folder = tmp_path / f"set{workers}"
        src = (d for d in docs) if one_shot else docs
        res = write_tokens(folder, src, None, num_workers=workers, docs_per_member=8, **kw)
        assert len(res.members) == 4 and res.dtype == one.dtype
        assert _set_dtypes(folder) == {one.dtype}
        merge_datasets(tmp_path / "m.pageset", _member_paths(folder), progress=False, lineage=False)
        assert (tmp_path / "m.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()
    assert list(tmp_path.glob("**/*spill*")) == []


def test_appending_pre_tokenized_ids_keeps_the_sets_dtype(tmp_path):
    kw = {"eos_id": 1, "num_workers": 0, "progress": False, "lineage": False, "docs_per_member": 2}
    small = [np.arange(2, 40) + k for k in range(4)]
    write_tokens(tmp_path / "s16", small, None, **kw)
    write_tokens(tmp_path / "s16", small[:2], None, append=True, **kw)
    assert _set_dtypes(tmp_path / "s16") == {"uint16"}
    with pytest.raises(ValueError, match=r"token id 70000 > 65535.*the set stores uint16.*dtype='uint32'"):
        write_tokens(tmp_path / "s16", [np.array([5, 70_000])], None, append=True, **kw)
    assert len(_member_paths(tmp_path / "s16")) == 3 and _set_dtypes(tmp_path / "s16") == {"uint16"}
    write_tokens(tmp_path / "s32", [np.array([5, 70_000])], None, **kw)
    write_tokens(tmp_path / "s32", small, None, append=True, **kw)  # ids that fit uint16, stored as the set's
    assert _set_dtypes(tmp_path / "s32") == {"uint32"}
