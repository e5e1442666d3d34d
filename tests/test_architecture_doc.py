"""docs/architecture.md names code as ``path:qualified.name``; every such anchor must still exist (a class, a
function or a method, found by parsing the module), so the map cannot silently drift from the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
ANCHOR = re.compile(r"`?(src/pageset/[\w/]+\.py):([A-Za-z_][\w.]*)")


def _defined(path: Path) -> set[str]:
    """Qualified names of the classes and functions a module defines (``Class``, ``Class.method``, ``func``)."""
    names: set[str] = set()

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    walk(node.body, f"{prefix}{node.name}.")

    walk(ast.parse(path.read_text(encoding="utf-8")).body, "")
    return names


def anchors(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2).rstrip(".")) for m in ANCHOR.finditer(text)]


def test_the_anchor_pattern_finds_what_the_doc_writes():
    assert anchors("see `src/pageset/load/ring.py:SlotRing._handout` and src/pageset/a/b.py:f.") == [
        ("src/pageset/load/ring.py", "SlotRing._handout"), ("src/pageset/a/b.py", "f")]


def test_every_anchor_of_the_architecture_page_exists():
    found = anchors(DOC.read_text(encoding="utf-8"))
    assert len(found) >= 40, len(found)
    missing = []
    cache: dict[str, set[str]] = {}
    for path, name in found:
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path} (no such module)")
            continue
        defined = cache.setdefault(path, _defined(file))
        if name not in defined:
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/architecture.md names code that is gone: {missing}"


def test_a_renamed_function_is_reported(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("class A:\n    def f(self):\n        pass\n\ndef g():\n    pass\n")
    assert _defined(mod) == {"A", "A.f", "g"}
