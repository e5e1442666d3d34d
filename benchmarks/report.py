"""What every benchmark table shares: run statistics, target entries, machine facts and markdown formatting.

Stdlib only (no numpy, torch or pageset at import), so the README generator and its test load it quickly.

A **target** is the contract every benchmark JSON follows in its top-level ``"targets"`` list::

    {"name": str, "measured": float | None, "target": float, "unit": str, "met": bool | None, "detail": str}

``unit`` "x" marks a ratio target. A target that could not be measured (a peer not installed, a benchmark that
failed) has ``measured`` and ``met`` None and a ``detail`` starting with "not run: " and the reason: never a
made-up number.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---- statistics of repeated runs ----------------------------------------------------------------------------
def stats(values) -> dict:
    """{"median", "min", "max", "runs"} of the finite values (None and NaN dropped); {} when none is left."""
    vals = [float(v) for v in values if v is not None and v == v]
    if not vals:
        return {}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": len(vals)}


def fmt_stats(s: dict | None, fmt: str = "{:.0f}", scale: float = 1.0, unit: str = "") -> str:
    """"1035 (990-1100)" from a ``stats`` dict: median, then min-max when there was more than one run."""
    if not s:
        return "-"
    med = fmt.format(s["median"] * scale) + unit
    if s.get("runs", 1) < 2:
        return med + " (1 run)"
    return f"{med} ({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"


# ---- targets ----------------------------------------------------------------------------------------------
def target(name: str, measured, goal: float, unit: str, detail: str = "", higher_is_better: bool = True) -> dict:
    """One target entry; ``met`` is measured >= goal (or <= with ``higher_is_better=False``)."""
    if measured is None or measured != measured:
        return not_run(name, goal, unit, detail or "no measurement")
    measured = float(measured)
    met = measured >= goal if higher_is_better else measured <= goal
    return {"name": name, "measured": measured, "target": float(goal), "unit": unit, "met": bool(met),
            "detail": detail, "higher_is_better": higher_is_better}


def not_run(name: str, goal: float, unit: str, why: str) -> dict:
    """A target that was not measured, with the reason (``detail`` = "not run: <why>")."""
    return {"name": name, "measured": None, "target": float(goal), "unit": unit, "met": None,
            "detail": f"not run: {why}"}


def check_target(t) -> str | None:
    """None if ``t`` follows the target contract, else what is wrong with it."""
    if not isinstance(t, dict):
        return f"not a dict: {t!r:.80}"
    missing = [k for k in ("name", "measured", "target", "unit", "met", "detail") if k not in t]
    if missing:
        return f"{t.get('name', '?')}: missing {', '.join(missing)}"
    if t["measured"] is not None and not isinstance(t["measured"], (int, float)):
        return f"{t['name']}: measured is {type(t['measured']).__name__}, not a number"
    if t["target"] is None and t["measured"] is None:  # a benchmark that did not run at all: no goal to show
        return None
    if not isinstance(t["target"], (int, float)):
        return f"{t['name']}: target is {type(t['target']).__name__}, not a number"
    if t["met"] is not None and not isinstance(t["met"], bool):
        return f"{t['name']}: met is {type(t['met']).__name__}, not a bool"
    return None


def _num(v: float, unit: str) -> str:
    if unit == "x":
        return f"{v:.2f}x"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.1f} M {unit}".rstrip()
    if a >= 100:
        return f"{v:,.0f} {unit}".rstrip()
    if a >= 1:
        return f"{v:.2f} {unit}".rstrip()
    return f"{v:.3g} {unit}".rstrip()


def targets_table(targets: list[dict]) -> list[str]:
    """Markdown lines: benchmark, target, measured, goal, measured / goal, met, detail."""
    lines = ["| benchmark | target | measured | goal | measured / goal | met | detail |",
             "|---|---|---|---|---|---|---|"]
    for t in targets:
        bad = check_target(t)
        bench = t.get("benchmark", "") if isinstance(t, dict) else ""
        if bad:
            lines.append(f"| {bench} | {t.get('name', '?') if isinstance(t, dict) else '?'} | - | - | - | - | "
                         f"malformed target entry: {bad} |")
            continue
        goal = t["target"]
        lower = t.get("higher_is_better") is False
        if goal is None:
            lines.append(f"| {bench} | {t['name']} | not run | - | - | - | {t['detail']} |")
            continue
        if t["measured"] is None:
            meas, ratio, met = "not run", "-", "-"
        else:
            meas = _num(t["measured"], t["unit"])
            ratio = f"{t['measured'] / goal:.2f}" if goal else "-"
            met = "yes" if t["met"] else "**no**"
        detail = str(t.get("detail", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {bench} | {t['name']} | {meas} | {'<= ' if lower else '>= '}{_num(goal, t['unit'])} | "
                     f"{ratio} | {met} | {detail} |")
    return lines


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def markdown_tables(text: str) -> list[dict]:
    """The markdown tables a benchmark printed: [{"caption": the last non-blank line printed between the previous
    table and this one ("" if none), "lines": [...]}]; blocks of fewer than 2 lines are dropped."""
    out, caption, cur = [], "", None
    for line in text.splitlines():
        s = line.rstrip()
        if s.startswith("|"):
            if cur is None:
                cur = {"caption": caption, "lines": []}
                out.append(cur)
                caption = ""  # a caption belongs to one table
            cur["lines"].append(s)
        else:
            cur = None
            if s.strip():
                caption = s.strip()
    return [t for t in out if len(t["lines"]) >= 2]


# ---- the machine -------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """HEAD of the repository, with "+dirty" when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def machine_facts() -> dict:
    """CPU model, cores (all and usable), RAM, load average now, OS, python/torch/numba/numpy/pillow versions,
    the GPU (torch's view; None without CUDA) and the git commit."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except ImportError:
        pass
    return {"cpu_model": _cpu_model(), "cpus": os.cpu_count(), "usable_cpus": usable,
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "platform": platform.platform(),
            "python": platform.python_version(),
            **{k: _version(k) for k in ("torch", "numba", "numpy", "pillow")},
            "gpu": gpu, "git_commit": git_commit(), "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def machine_line(m: dict, loadavg_end=None) -> str:
    """One sentence of machine facts for a table header."""
    load = f"load average {m['loadavg'][0]:.1f}"
    if loadavg_end:
        load += f" at start, {loadavg_end[0]:.1f} at end"
    cores = f"{m['cpus']} cores" + (f" ({m['usable_cpus']} usable)" if m.get("usable_cpus") not in (None, m["cpus"]) else "")
    versions = ", ".join(f"{k} {m[k]}" for k in ("python", "torch", "numba", "numpy", "pillow") if m.get(k))
    return (f"{m['cpu_model']}, {cores}, {m['mem_gb']} GB RAM, {'GPU: ' + m['gpu'] if m.get('gpu') else 'no GPU'}; "
            f"{load}; {versions}; commit {m.get('git_commit') or '?'}; {m.get('time_utc', '')}")
