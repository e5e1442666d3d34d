"""Conventions a PyTorch user relies on: one array type per batch (torch tensors unless numpy is asked for),
``len(loader)`` = steps per epoch like ``DataLoader``, token files opened as what they are, file lists that move
with their images, ``pageset --version``, and one argument order (output first) for every function that writes."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from importlib.metadata import version

import numpy as np
import pytest
import torch
from PIL import Image

import pageset
from pageset import (
    JSON,
    Bytes,
    Dataset,
    FormatError,
    Int,
    Loader,
    NDArray,
    Normalize,
    PipelineError,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    ToTensor,
    ToTorchImage,
    import_nanogpt,
    open_dataset,
    open_tokens,
    write_dataset,
    write_tokens,
)
from pageset.cli import main as cli_main


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory, photo_arrays):
    """Every record field kind: image, int, ndarray, bytes, JSON (10 records)."""
    path = tmp_path_factory.mktemp("conv") / "mixed.pageset"
    rows = [(photo_arrays[k % len(photo_arrays)][:40, :48], k, np.full((2, 3), k, np.float32), bytes([k] * (k + 1)),
             {"k": k}) for k in range(10)]
    write_dataset(path, rows, {"image": RGBImage(), "label": Int(), "vec": NDArray("float32", (2, 3)),
                               "raw": Bytes(), "meta": JSON()}, num_workers=0, progress=False)
    return path


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "tokens.pageset"
    write_tokens(path, [np.arange(1, 300), np.arange(5, 90)], None, eos_id=0, num_workers=0, progress=False)
    return path


def _arrays(batch):
    """Every array value of a batch (tuples opened), JSON lists and ints left out."""
    out = {}
    for key, value in batch.items():
        for k, v in enumerate(value if isinstance(value, tuple) else (value,)):
            if not isinstance(value, (list, int)):
                out[f"{key}[{k}]"] = v
    return out


def test_one_array_type_per_batch_torch_by_default(mixed_file, token_file):
    pipes = {"image": [RandomResizedCrop(16)]}
    with Loader(mixed_file, batch_size=4, pipelines=pipes, num_threads=1) as loader:
        batch = next(iter(loader))
    arrays = _arrays(batch)
    assert set(arrays) == {"image[0]", "label[0]", "vec[0]", "raw[0]", "raw[1]", "_index[0]", "_is_padding[0]"}
    assert all(isinstance(v, torch.Tensor) for v in arrays.values()), {k: type(v) for k, v in arrays.items()}
    assert batch["label"].dtype == torch.int64 and batch["_is_padding"].dtype == torch.bool
    assert batch["meta"] == [{"k": int(i)} for i in batch["_index"]]  # JSON: Python values
    with Loader(token_file, batch_size=2, num_threads=1,
                pipelines={"tokens": [TokenWindows(16, document_outputs=True)]}) as loader:
        batch = next(iter(loader))
    arrays = _arrays(batch)
    assert all(isinstance(v, torch.Tensor) for v in arrays.values()) and isinstance(batch["max_seqlen"], int)
    assert {"input[0]", "target[0]", "position_ids[0]", "labels[0]", "cu_seqlens[0]", "_index[0]"} <= set(arrays)


def test_numpy_when_asked_for_and_never_mixed(mixed_file, token_file):
    with Loader(mixed_file, batch_size=4, pipelines={"image": [RandomResizedCrop(16)]}, num_threads=1,
                array_type="numpy") as loader:
        batch = next(iter(loader))
    with Loader(mixed_file, batch_size=4, pipelines={"image": [RandomResizedCrop(16)]}, num_threads=1) as loader:
        tensors = next(iter(loader))
    arrays = _arrays(batch)
    assert all(isinstance(v, np.ndarray) for v in arrays.values()), {k: type(v) for k, v in arrays.items()}
    for key, value in _arrays(tensors).items():  # the same values either way
        assert np.array_equal(value.numpy(), arrays[key]), key
    with Loader(token_file, batch_size=2, num_threads=1, array_type="numpy",
                pipelines={"tokens": [TokenWindows(16)]}) as loader:
        assert all(isinstance(v, np.ndarray) for v in _arrays(next(iter(loader))).values())
    for op in (ToTensor(), ToTorchImage()):  # a torch op would mix the types: refused, naming the way out
        with pytest.raises(PipelineError, match=rf"{type(op).__name__} hands out torch tensors.*array_type='numpy'"):
            Loader(mixed_file, batch_size=4, array_type="numpy", pipelines={"image": [RandomResizedCrop(16), op]})
    with pytest.raises(PipelineError, match="numpy has no bfloat16"):
        Loader(mixed_file, batch_size=4, array_type="numpy",
               pipelines={"image": [RandomResizedCrop(16), Normalize(dtype="bfloat16")]})
    with pytest.raises(PipelineError, match="ToTensor hands out torch tensors"):
        Loader(mixed_file, batch_size=4, array_type="numpy", pipelines={"image": None, "label": [ToTensor()]})


@pytest.mark.parametrize("drop_last", [True, False])
def test_len_is_steps_per_epoch_like_dataloader_and_steps_remaining_the_rest(mixed_file, drop_last):
    kw = dict(batch_size=3, drop_last=drop_last, num_threads=1, pipelines={"image": None, "meta": None})
    reference = len(torch.utils.data.DataLoader(range(10), batch_size=3, drop_last=drop_last))
    with Loader(mixed_file, **kw) as loader:
        assert len(loader) == reference == loader.steps_per_epoch == loader.steps_remaining
        it = iter(loader)
        next(it)
        assert len(loader) == reference and loader.steps_remaining == reference - 1
        state = loader.state_dict()
        rest = sum(1 for _ in it)
        assert rest == reference - 1 and len(loader) == reference == loader.steps_remaining  # next epoch: whole
    with Loader(mixed_file, **kw) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == reference and resumed.steps_remaining == reference - 1
        assert sum(1 for _ in resumed) == reference - 1
    with Loader(mixed_file, rank=1, world_size=2, **kw) as ranked:  # per rank: global batch 6
        assert len(ranked) == len(torch.utils.data.DataLoader(range(10), batch_size=6, drop_last=drop_last))


def test_open_dataset_refuses_a_token_file_naming_open_tokens(token_file, mixed_file, capsys):
    with pytest.raises(ValueError, match=r"is a token file \(386 tokens in 2 documents, no records\): open it with "
                                         r"pageset\.open_tokens\(path\)"):
        open_dataset(token_file)
    with pytest.raises(FormatError, match=r"not a token file.*use open_dataset\(\)"):  # and the other way round
        open_tokens(mixed_file)
    with open_tokens(token_file) as td:
        assert len(td) == 386 and td.documents == 2
    with Dataset(token_file) as ds:  # either kind, for header, schema and verify()
        ds.verify()
    assert cli_main(["inspect", str(token_file)]) == 0 and "386 tokens in 2 documents" in capsys.readouterr().out
    assert cli_main(["verify", str(token_file)]) == 0


def test_file_list_paths_are_relative_to_the_list_folder(tmp_path, photos, monkeypatch):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for k in range(3):
        Image.open(photos[k]).convert("RGB").resize((32, 24)).save(data / ("sub" if k else ".") / f"{k}.jpg")
    absolute = tmp_path / "elsewhere.jpg"
    shutil.copy(data / "sub" / "1.jpg", absolute)
    (data / "files.txt").write_text(f"0.jpg\t0\nsub/1.jpg\t1\n./sub/2.jpg\t2\n{absolute}\t3\n")
    other = tmp_path / "cwd"
    other.mkdir()
    monkeypatch.chdir(other)  # neither the list's folder nor its parent
    res = write_dataset("from_api.pageset", "../data/files.txt", num_workers=0, progress=False)
    assert cli_main(["convert", "from_cli.pageset", "../data/files.txt", "--no-progress"]) == 0
    for name in ("from_api.pageset", "from_cli.pageset"):
        with open_dataset(name) as ds:
            assert [ds[i]["label"] for i in range(len(ds))] == [0, 1, 2, 3]
            assert [ds[i]["image"].width for i in range(len(ds))] == [32] * 4
    assert res.records == 4 and sorted(os.listdir(other)) == ["from_api.pageset", "from_cli.pageset"]


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as ei:
        cli_main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"pageset {version('pageset')} (file format 1.1)"
    proc = subprocess.run([sys.executable, "-m", "pageset", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("pageset ")


WRITERS = ("write_dataset", "write_tokens", "import_nanogpt", "import_llmc", "import_megatron", "merge_datasets")


def test_every_public_writer_takes_the_output_first():
    """One order for every function that writes a file: the output ``path`` first, then what it reads."""
    writers = [n for n in pageset.__all__ if n.startswith(("write_", "import_", "convert_", "merge_"))]
    assert set(WRITERS) <= set(writers)
    for name in writers:
        params = list(inspect.signature(getattr(pageset, name)).parameters.values())
        assert params[0].name == "path", f"{name}: the output comes first, named path; got {params[0].name}"
        assert params[0].kind == params[0].POSITIONAL_OR_KEYWORD and params[1].kind == params[1].POSITIONAL_OR_KEYWORD


def test_swapped_importer_arguments_never_overwrite_the_source(tmp_path):
    nano = tmp_path / "train.bin"
    stream = np.array([5, 6, 50256, 7], np.uint16)
    stream.tofile(nano)
    out = tmp_path / "train.pageset"
    import_nanogpt(out, nano)
    before = nano.read_bytes()
    with pytest.raises(ValueError, match=r"train\.pageset is a pageset file, not a source to import; the output "
                                         r"comes first"):
        import_nanogpt(nano, out)  # the old (bin_path, path) order
    val = tmp_path / "val.bin"
    stream.tofile(val)
    with pytest.raises(ValueError, match=r"train\.bin exists and is not a pageset file: refusing to replace it"):
        import_nanogpt(nano, val)  # swapped, both sources: the "output" would be a source file
    assert nano.read_bytes() == before


def test_swapped_writer_arguments_never_overwrite_the_source(tmp_path, photos, imagenet_like):
    # Like the importers: write_dataset / write_tokens / merge_datasets / `pageset convert` refuse to replace an
    # existing file that is not a pageset file (the source, when output and source are swapped).
    from pageset import merge_datasets
    from pageset.cli import main

    corpus, other = tmp_path / "corpus.jsonl", tmp_path / "other.jsonl"
    corpus.write_text('{"text": "one document"}\n')
    other.write_text('{"text": "another"}\n')
    files = tmp_path / "files.txt"
    files.write_text("".join(f"{p}\n" for p in photos[:2]))
    good = tmp_path / "good.pageset"
    write_dataset(good, [(1,), (2,)], {"a": Int()}, progress=False)
    before = {p: p.read_bytes() for p in (corpus, other, files)}
    with pytest.raises(ValueError, match=r"corpus\.jsonl exists and is not a pageset file: refusing to replace it.*"
                                         r"write_tokens\(path, source, tokenizer\)"):
        write_tokens(corpus, other, None, eos_id=0)
    with pytest.raises(ValueError, match=r"files\.txt exists and is not a pageset file.*write_dataset\(path"):
        write_dataset(files, imagenet_like, progress=False)
    with pytest.raises(ValueError, match=r"other\.jsonl exists and is not a pageset file.*merge_datasets"):
        merge_datasets(other, [good])
    assert main(["convert", str(files), str(imagenet_like), "--no-progress"]) == 1  # swapped on the CLI (OUTPUT first)
    assert {p: p.read_bytes() for p in before} == before
    # A pageset file or an empty file is replaced as before.
    write_dataset(good, [(3,)], {"a": Int()}, progress=False)
    empty = tmp_path / "empty.pageset"
    empty.touch()
    write_dataset(empty, [(3,)], {"a": Int()}, progress=False)
    with open_dataset(good) as a, open_dataset(empty) as b:
        assert len(a) == len(b) == 1


def test_file_list_on_an_executor_gives_the_same_bytes(tmp_path, photos):
    """A file list is cut into row slices for executor tasks (paths already resolved against the list's folder)."""
    from concurrent.futures import ProcessPoolExecutor

    for k in range(5):
        Image.open(photos[k]).convert("RGB").resize((24, 16)).save(tmp_path / f"{k}.jpg")
    (tmp_path / "files.txt").write_text("".join(f"{k}.jpg\t{k}\n" for k in range(5)))
    kw = dict(progress=False, lineage=False)
    write_dataset(tmp_path / "a.pageset", tmp_path / "files.txt", num_workers=0, **kw)
    with ProcessPoolExecutor(2) as ex:
        write_dataset(tmp_path / "b.pageset", tmp_path / "files.txt", executor=ex, chunk_size=2, **kw)
    assert (tmp_path / "a.pageset").read_bytes() == (tmp_path / "b.pageset").read_bytes()


def test_resume_errors_are_exported_and_token_subsets_count_windows(token_file):
    """StateError / StateMismatchError (raised by load_state_dict) can be caught as pageset.StateError; a
    subset of a token file is counted in seq_len windows, and its errors say so."""
    from pageset.order.state import StateError, StateMismatchError

    assert pageset.StateError is StateError and pageset.StateMismatchError is StateMismatchError
    assert {"StateError", "StateMismatchError"} <= set(pageset.__all__)
    with pytest.raises(ValueError, match=r"indices\[0\] = 99 is outside \[0, 24\) \(the file has 24 windows\) "
                                         r"\(a token file's ids are its seq_len=16 windows\)"):
        Loader(token_file, batch_size=2, indices=[99], pipelines={"tokens": [TokenWindows(16)]})
