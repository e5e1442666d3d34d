"""The reference model under tests/reference/ must not share code with the product: stdlib imports only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REFERENCE = Path(__file__).parent / "reference"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import stays inside tests/reference
                continue
            names.add(node.module.split(".")[0])
    return names


def test_reference_modules_import_only_the_standard_library():
    modules = sorted(REFERENCE.glob("*.py"))
    assert any(p.name == "format.py" for p in modules)
    for path in modules:
        foreign = {n for n in _imports(path) if n != "__future__" and n not in sys.stdlib_module_names}
        assert not foreign, f"{path.name} imports {sorted(foreign)}: the reference model must be independent"


def test_the_import_check_sees_a_product_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import json\nfrom pageset.read import reader\nimport numpy as np\n")
    assert _imports(bad) - set(sys.stdlib_module_names) == {"pageset", "numpy"}
