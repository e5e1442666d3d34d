"""Issue 29's golden corpus: every batch and ``state_dict()`` of ~50 Loader configurations (images jpeg/raw,
token windows, packed rows, chat masks, subsets, Mixtures, many-file sets read flat and per member, local and
HTTP, 1 and 2 threads, the process mode, resumes on the same and on another world size) hashes as it did on the
commit recorded in ``tests/golden/batches.json`` (recorded with ``tools/record_golden.py`` before the read side was
redesigned). A refactor that changes one byte of one batch, or of a state, fails here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import corpus  # noqa: E402
from remote_servers import StaticHTTP  # noqa: E402

RECORDED = json.loads((Path(__file__).resolve().parent / "golden" / "batches.json").read_text())


@pytest.fixture(scope="module")
def golden_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    files = corpus.build(root)
    with StaticHTTP(root) as http:
        yield files, http.url


def test_every_configuration_is_recorded():
    assert sorted(RECORDED["configs"]) == sorted(corpus.CONFIGS)
    assert len(corpus.CONFIGS) >= 40


@pytest.mark.parametrize("name", sorted(corpus.CONFIGS))
def test_batches_and_states_equal_the_recorded_hashes(golden_files, name):
    files, url = golden_files
    got = corpus.run(name, files, url)
    assert got == RECORDED["configs"][name], (
        f"{name}: the batches or state differ from those recorded on {RECORDED['commit']} (a changed byte; "
        f"if the change is intended, say why and re-record with tools/record_golden.py --only {name})")
