"""Counts the README states about the suite, kept in sync with what they count (as test_bench_tables.py keeps
README's tables in sync with docs/bench/results.json): a list that grows without its count fails here."""

from __future__ import annotations

import re
from pathlib import Path

from test_mutations import MUTATIONS

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_states_the_number_of_curated_mutations():
    text = README.read_text(encoding="utf-8")
    stated = re.findall(r"`tests/test_mutations\.py`[^.]*?applies (\d+) hand-picked\s+mutations", text)
    assert stated, "README no longer states how many curated mutations tests/test_mutations.py applies"
    assert [int(n) for n in stated] == [len(MUTATIONS)], (
        f"README says {stated} curated mutations, tests/test_mutations.py lists {len(MUTATIONS)}: update README.md")
