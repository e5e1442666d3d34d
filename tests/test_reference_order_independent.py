"""tests/reference/order.py is a fixed point that shares no code with the product: it imports only the standard
library (no pageset, numpy, numba or torch), so a bug in pageset cannot also change the model."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "reference" / "order.py"


def test_reference_order_imports_only_the_standard_library():
    tree = ast.parse(MODEL.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in {MODEL}: {ast.dump(node)}"
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("__import__", "exec", "eval"):
            raise AssertionError(f"{MODEL} calls {node.func.id}: imports must be plain import statements")
    assert imported, "no imports found: is the model empty?"
    foreign = sorted(m for m in imported if m != "__future__" and m not in sys.stdlib_module_names)
    assert not foreign, f"{MODEL} imports non-stdlib modules {foreign}"
