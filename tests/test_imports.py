"""Architecture rules: one-way imports between stages, no import-time side effects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pageset"
# stage -> stages it may import (format <- write/read <- order/ops <- load <- device)
ALLOWED = {
    "format": set(),
    "order": set(),
    "write": {"format"},
    "read": {"format"},
    "ops": {"format", "order"},
    "load": {"format", "read", "order", "ops"},
    "device": {"format", "read", "order", "ops", "load"},
}
THIRD_PARTY = {  # heavy dependencies allowed per stage
    "format": {"numpy"},
    "order": {"numpy", "numba"},
}


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg_parts = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ((node.module,) if node.module else ()))
            else:
                mod = node.module or ""
            yield mod
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name


def test_stage_imports_point_one_way():
    bad = []
    for stage, allowed in ALLOWED.items():
        folder = SRC / stage
        for path in folder.rglob("*.py"):
            for mod in _imports(path):
                parts = mod.split(".")
                if parts[0] == "pageset" and len(parts) > 1 and parts[1] in ALLOWED:
                    if parts[1] != stage and parts[1] not in allowed:
                        bad.append(f"{path.relative_to(SRC)} imports {mod}")
                elif parts[0] == "pageset" and len(parts) > 1 and parts[1] not in ALLOWED:
                    bad.append(f"{path.relative_to(SRC)} imports top-level module {mod}")
                if stage in THIRD_PARTY and parts[0] in {"torch", "numba", "PIL", "tqdm"}:
                    if parts[0] not in THIRD_PARTY[stage]:
                        bad.append(f"{path.relative_to(SRC)} imports {parts[0]}")
    assert not bad, bad


# Inside ops, module -> the ops modules it may import: each kernel module holds one stage of the image path
# (library binding, DCT-scale arithmetic, decode kernels, crop sampling, resize weights, resize passes) and
# depends only on the stages below it; the facades (jpeg, image) and the fused slice kernel sit on top.
OPS_LAYERS = {
    "kernel_cache": set(),  # the on-disk cache switch, used by each stage's prepare()
    "turbo": set(),  # libjpeg-turbo's symbols for kernels
    "jpeg_scale": {"turbo"},  # DCT scale, region and scratch arithmetic
    "jpeg_restart": set(),  # restart intervals: the sub-JPEG of a crop's intervals (markers only, no library)
    "jpeg_kernels": {"turbo", "jpeg_scale", "jpeg_restart"},  # jpeg_info / jpeg_decode
    "jpeg": {"turbo", "jpeg_scale", "jpeg_restart", "jpeg_kernels", "kernel_cache"},  # JpegDecoder, prepare(); re-exports the kernels
    "crop": set(),  # crop boxes and flips (order.keys only)
    "resize_weights": set(),  # Pillow's fixed-point filter weights
    "resize": {"resize_weights"},  # the resize -> flip -> normalize kernel
    "resize_fast": {"resize", "resize_weights"},  # the fast resize mode (reuses the exact kernel's checks)
    "image": {"crop", "resize", "resize_weights"},  # value tables; re-exports crop and resize
    "image_batch": {"jpeg", "jpeg_kernels", "jpeg_scale", "crop", "resize", "resize_fast", "resize_weights",
                    "kernel_cache"},
    "spans": {"kernel_cache"},
    "tokens": {"spans", "kernel_cache"},  # token windows read with spans.pread_full
    "transforms": set(),
}


def _ops_imports(path: Path):
    """The ``pageset.ops`` modules ``path`` imports (``from pageset.ops import x``, ``from .x import y``, ...)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(("pageset", "ops")[: 3 - node.level] + ((node.module,) if node.module else ()))
            else:
                mod = node.module or ""
            if mod == "pageset.ops":
                yield from (alias.name for alias in node.names)
            elif mod.startswith("pageset.ops."):
                yield mod.split(".")[2]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pageset.ops."):
                    yield alias.name.split(".")[2]


def test_ops_modules_import_one_way():
    bad = []
    for name, allowed in OPS_LAYERS.items():
        path = SRC / "ops" / f"{name}.py"
        assert path.is_file(), f"OPS_LAYERS lists {name}, but {path} does not exist"
        for mod in set(_ops_imports(path)) - {name}:
            if mod not in allowed:
                bad.append(f"ops/{name}.py imports ops.{mod} (allowed: {sorted(allowed)})")
    assert not bad, bad


def test_torch_only_in_load_and_device():
    offenders = []
    for path in SRC.rglob("*.py"):
        stage = path.relative_to(SRC).parts[0]
        if stage in ("load", "device"):
            continue
        if any(m.split(".")[0] == "torch" for m in _imports(path)):
            offenders.append(str(path.relative_to(SRC)))
    assert not offenders, offenders


def test_import_has_no_side_effects():
    code = (
        "import os, sys, threading; before = set(os.environ.items()); n = threading.active_count();"
        "import pageset, pageset.cli;"
        "assert set(os.environ.items()) == before, 'environment changed';"
        "assert threading.active_count() == n, 'threads started';"
        "assert 'torch' not in sys.modules, 'torch imported by the writer/reader facade';"
        "assert 'fsspec' not in sys.modules, 'fsspec imported without a URL'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


REMOTE_PACKAGES = {"fsspec", "s3fs", "aiohttp", "gcsfs", "adlfs", "botocore", "aiobotocore"}
# the modules that talk to fsspec (reading URLs; writing to and sharding through URLs; checking a URL output;
# WebDataset shards and text sources at URLs), only inside functions
REMOTE_MODULES = {"read/remote.py", "write/output.py", "write/ranges.py", "write/external.py",
                  "write/upload.py", "write/tokens/set_members.py", "write/members.py", "read/set_manifest.py",
                  "write/documents.py"}


def test_fsspec_only_lazily_in_the_url_modules():
    """Local paths keep today's cost: fsspec and its backends are imported only by the modules that handle URLs,
    inside the functions that open one, never at module level anywhere."""
    bad = []
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] in REMOTE_PACKAGES for n in names):
                if rel not in REMOTE_MODULES or id(node) in top:
                    bad.append(f"{rel}:{node.lineno} imports {names}")
    assert not bad, bad


def test_local_loader_does_not_import_fsspec(tmp_path):
    code = (
        "import sys; from pageset import write_dataset, open_dataset, Int, Loader;"
        f"p = {str(tmp_path / 'x.pageset')!r};"
        "write_dataset(p, [(i,) for i in range(10)], {'label': Int()}, num_workers=0, progress=False);"
        "ds = open_dataset(p); ds.verify(); ds.close();"
        "loader = Loader(p, batch_size=2, num_threads=1); list(loader); loader.close();"
        "assert 'fsspec' not in sys.modules, 'fsspec imported for a local path'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _module_graph() -> dict[str, set[str]]:
    """pageset module -> the pageset modules it imports anywhere in its body (top level or inside a function),
    package facades (``__init__``) left out: they re-export and are imported, never the other way."""
    def name(p: Path) -> str:
        return ".".join(("pageset",) + p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")

    mods = {name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for mod, path in mods.items():
        if path.name == "__init__.py":
            continue
        pkg = mod.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[mod] = {d for d in deps if d in mods and d != mod and mods[d].name != "__init__.py"}
    return graph


def test_no_import_cycles():
    """No two modules import each other, directly or through others, not even lazily inside a function (a lazy
    import hides a cycle from Python, not from the design: read/reader.py <-> read/tokens.py was one)."""
    graph = _module_graph()
    assert graph["pageset.read.reader"], "the module graph is empty: the walk is broken"
    cycles, done = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        seen = set()
        while stack:  # bounded: every module is pushed at most once per start
            mod, chain = stack.pop()
            for dep in sorted(graph[mod]):
                if dep == start:
                    cycle = frozenset(chain)
                    if cycle not in done:
                        done.add(cycle)
                        cycles.append(" -> ".join(chain + [start]))
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, chain + [dep]))
    assert not cycles, cycles


def test_the_facade_loads_the_writers_on_first_use():
    """``import pageset`` (what a Loader-only process pays before the Loader) leaves the writers and Pillow out;
    the writer names still resolve, from their own modules."""
    code = ("import sys, pageset; assert 'pageset.write' not in sys.modules and 'PIL' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('pageset.write', 'PIL')));"
            "from pageset import write_dataset, write_tokens, merge_datasets, import_nanogpt, ImageFolder;"
            "assert write_dataset.__module__ == 'pageset.write.writer', write_dataset.__module__;"
            "assert write_tokens.__module__ == 'pageset.write.tokens', write_tokens.__module__;"
            "assert merge_datasets.__module__ == 'pageset.merge'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> modules of the same tree it imports, at any depth of its code (lazy imports count too);
    ``from . import x`` depends on the submodule ``x`` when there is one, else on the package."""
    mods = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                deps.update(subs)
                if len(subs) < len(node.names) and target in mods:
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
        graph[m] = deps - {m}
    assert any(m.startswith(package) for m in graph)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package_or_the_benchmarks():
    """No module imports, directly or through others, a module that imports it, lazy imports included."""
    assert _cycles(_graph(SRC, "pageset")) == []
    assert _cycles(_graph(SRC.parents[1] / "benchmarks", "benchmarks")) == []


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
