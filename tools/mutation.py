"""Mutation testing of the modules whose bugs corrupt data silently (issue 10), with mutmut.

Why mutmut (3.x) rather than cosmic-ray: mutmut records which tests reach each function (one traced pass of the
selected tests) and then runs only those tests per mutant, in a process forked from one that already imported
numpy/numba/torch and compiled the kernels, so a mutant costs the covering tests' time, not a fresh interpreter
(cosmic-ray starts the whole test command per mutant: ~5-10 s of imports and JIT each on this project). Its
limit: it does not mutate decorated functions, so the ``@numba.njit`` kernels (crop boxes, resize, the
quasi-random windows) are not mutated by it; ``tests/test_mutations.py`` (the curated list, in CI) carries
hand-written mutations of those kernels instead.

Scope and test selection are in ``[tool.mutmut]`` of pyproject.toml. Run from the repository root::

    python tools/mutation.py                       # all modules in scope, then the per-module table
    python tools/mutation.py order.sharding tokens # only mutants whose name matches (module path fragments)
    python tools/mutation.py --report              # table of the last run, survivors listed
    python tools/mutation.py --budget 3600         # stop after this many seconds of wall time (default 3600)
    python tools/mutation.py --survivors           # retest only the last run's survivors (after new tests)
    python tools/mutation.py --recheck-timeouts    # rerun "timeout" mutants' covering tests without mutmut's limit

It runs ``nice -n 10 mutmut run`` (results are cached in ``mutants/``, git-ignored: a rerun only retests
mutants whose source or tests changed) and prints kill rate per module; ``mutmut show NAME`` shows a survivor's
diff. Needs the ``mutation`` extra (``pip install mutmut==3.8.1``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mutmut() -> str:
    exe = shutil.which("mutmut") or str(pathlib.Path(sys.executable).with_name("mutmut"))
    if not pathlib.Path(exe).exists():
        sys.exit("mutmut is not installed: pip install 'mutmut==3.8.1' (the `mutation` extra)")
    return exe


def run(patterns: list[str], budget_s: float, max_children: int, exact: bool = False) -> int:
    names = patterns if exact else [f"pageset.{p}*" if not p.startswith("pageset.") else f"{p}*" for p in patterns]
    cmd = ["nice", "-n", "10", _mutmut(), "run", "--max-children", str(max_children), *names]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/src first itself
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        print(f"budget of {budget_s:.0f} s spent: stopping mutmut (finished mutants keep their results)", flush=True)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout=60)


def results() -> dict[str, dict[str, str]]:
    """{module: {mutant name: status}} from the ``.meta`` files mutmut writes next to each mutated file."""
    from mutmut.stats import status_by_exit_code

    out: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        module = meta.relative_to(ROOT / "mutants" / "src").as_posix().removesuffix(".py.meta").replace("/", ".")
        for name, code in data.get("exit_code_by_key", {}).items():
            out[module][name] = status_by_exit_code[code]
    return out


def report(show_survivors: bool = True) -> None:
    res = results()
    print(f"{'module':32} {'mutants':>7} {'checked':>7} {'killed':>6} {'survived':>8} {'timeout':>7} "
          f"{'no tests':>8} {'kill rate':>9}")
    for module, by_name in sorted(res.items()):
        c = collections.Counter(by_name.values())
        checked = sum(v for k, v in c.items() if k not in ("not checked", "skipped"))
        killed = c["killed"] + c["segfault"] + c["caught by type check"]  # a timeout is not a kill (see below)
        rate = f"{100 * killed / checked:.1f}%" if checked else "-"
        print(f"{module:32} {len(by_name):7} {checked:7} {c['killed']:6} {c['survived']:8} {c['timeout']:7} "
              f"{c['no tests']:8} {rate:>9}")
        if c["timeout"]:
            print(f"{'':32} {c['timeout']} timeout(s) not counted as killed: rerun them with --recheck-timeouts")
    if show_survivors:
        for module, by_name in sorted(res.items()):
            surv = [n for n, s in by_name.items() if s in ("survived", "no tests", "suspicious")]
            if surv:
                print(f"\n{module}: {len(surv)} survivors / no tests")
                for n in surv:
                    print("   ", n, by_name[n])


def recheck_timeouts(patterns: list[str], cap_s: float = 900.0) -> None:
    """Rerun each "timeout" mutant's covering tests (``mutants/mutmut-stats.json``) with ``MUTANT_UNDER_TEST`` set
    and no mutmut time limit (``cap_s`` per mutant), the executor tests last, and record the verdict in its
    ``.meta`` file (exit code 1: killed, 0: survived).

    Why: mutmut derives a mutant's limit from its covering tests' measured call times, which leave out module
    fixtures; tests that start a Dask or Ray cluster then "time out" while still starting, and a survivor passes for
    killed (write/ranges.py: 10 of 17 timeouts were survivors, tests/mutation_equivalents.md)."""
    from mutmut.stats import status_by_exit_code

    timeout_codes = {c for c, st in status_by_exit_code.items() if st == "timeout"}
    stats = json.loads((ROOT / "mutants" / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        codes = data.get("exit_code_by_key", {})
        todo = [n for n, c in codes.items() if c in timeout_codes and (not patterns or any(p in n for p in patterns))]
        for name in todo:
            func = name.rsplit("__mutmut_", 1)[0]
            tests = sorted(stats.get(func, []), key=lambda t: ("test_cluster" in t, t))
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env.update(MUTANT_UNDER_TEST=name, PYTHONPATH="src")
            t0 = time.monotonic()
            try:
                proc = subprocess.run(["nice", "-n", "10", sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                       "no:cacheprovider", "-W", "ignore::RuntimeWarning", *tests],
                                      cwd=ROOT / "mutants", env=env, capture_output=True, timeout=cap_s)
            except subprocess.TimeoutExpired:
                print(f"{name}: still running after {cap_s:.0f} s: left as a timeout", flush=True)
                continue
            codes[name] = 1 if proc.returncode != 0 else 0
            print(f"{name}: {'killed' if codes[name] else 'SURVIVED'} ({len(tests)} tests, "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
        meta.write_text(json.dumps(data))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patterns", nargs="*", help="module fragments, e.g. order.sharding ops.tokens (default: all)")
    ap.add_argument("--budget", type=float, default=3600.0, help="wall-time limit in seconds (default 3600)")
    ap.add_argument("--max-children", type=int, default=2, help="parallel mutants (default 2)")
    ap.add_argument("--report", action="store_true", help="only print the table of the last run")
    ap.add_argument("--survivors", action="store_true", help="retest the last run's survivors (and 'no tests')")
    ap.add_argument("--recheck-timeouts", action="store_true",
                    help="rerun the 'timeout' mutants' covering tests without mutmut's limit and record the verdict")
    args = ap.parse_args(argv)
    if args.recheck_timeouts:
        recheck_timeouts(args.patterns)
    elif args.survivors:
        frag = tuple(args.patterns)
        names = [n for by_name in results().values() for n, st in by_name.items()
                 if st in ("survived", "no tests", "suspicious") and (not frag or any(f in n for f in frag))]
        if not names:
            print("no survivors to retest")
        else:
            reset = ROOT / "mutants" / "mutmut-stats.json"  # the covering tests changed: trace them again
            if reset.exists():
                reset.unlink()
            t0 = time.monotonic()
            rc = run(names, args.budget, args.max_children, exact=True)
            print(f"mutmut exited with {rc} after {time.monotonic() - t0:.0f} s ({len(names)} mutants)", flush=True)
    elif not args.report:
        t0 = time.monotonic()
        rc = run(args.patterns, args.budget, args.max_children)
        print(f"mutmut exited with {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
