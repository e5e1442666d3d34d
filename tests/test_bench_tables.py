"""README's benchmark tables come from docs/bench/results.json, never from hand-typed numbers.

benchmarks/tables.py turns a ``benchmarks.run_all`` result into the markdown between README's
``<!-- bench:NAME -->`` markers; a README edited by hand, or a results.json re-run without
``python -m benchmarks.tables --write``, fails here. No benchmark runs: this reads the committed JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks package lives beside src/, not inside it

from benchmarks import report, tables  # noqa: E402
from benchmarks.peers.measure import PeakRSS  # noqa: E402

RESULTS = ROOT / "docs" / "bench" / "results.json"


def _committed():
    return json.loads(RESULTS.read_text())


def test_readme_tables_equal_what_the_committed_json_generates():
    res, text = _committed(), (ROOT / "README.md").read_text()
    names = [m.group(1) for m in tables.MARKER.finditer(text)]
    assert text.count("<!-- bench:") == len(names) == text.count("<!-- /bench:"), "an unclosed bench marker"
    assert {"targets", "loaders", "images", "tokens", "write"} <= set(names), names
    assert tables.stale_blocks(text, res) == [], "README is stale: python -m benchmarks.tables --write"
    assert tables.render_readme(text, res) == text
    assert (ROOT / "docs" / "bench" / "results.md").read_text() == tables.results_md(res)


def test_check_command_fails_on_a_hand_edited_table(tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    readme.write_text(text)
    cmd = [sys.executable, "-m", "benchmarks.tables", "--check", "--readme", str(readme), "--results", str(RESULTS)]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    start = text.index("<!-- bench:targets -->")
    end = text.index("<!-- /bench:targets -->")
    readme.write_text(text[:end] + "| a | hand-typed | 9999 | row |\n" + text[end:])
    assert start < end
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "targets" in bad.stdout, bad.stdout + bad.stderr


def test_committed_targets_follow_the_contract():
    res = _committed()
    assert res["targets"], "results.json has no targets"
    for t in res["targets"]:
        if t["name"] == "(whole benchmark)":  # a benchmark that failed or wrote no targets: says why
            assert t["measured"] is None and t["detail"].startswith("not run: "), t
            continue
        assert report.check_target(t) is None, report.check_target(t)
        if t["measured"] is None:
            assert t["met"] is None and t["detail"].startswith("not run: "), t


def test_targets_table_says_not_run_and_never_invents_a_number():
    ts = [report.target("loader vs peer", 3.0, 1.5, "x", "median of 3"),
          report.target("rss growth", 12.0, 10.0, "%", higher_is_better=False),
          report.not_run("vs FFCV", 1.5, "x", "benchmarks/.envs/ffcv missing"),
          {"name": "broken", "measured": "fast"}]
    lines = report.targets_table(ts)
    assert lines[2].split("|")[3:7] == [" 3.00x ", " >= 1.50x ", " 2.00 ", " yes "]
    assert "**no**" in lines[3] and "<= 10.00 %" in lines[3]
    assert "| not run |" in lines[4] and "not run: benchmarks/.envs/ffcv missing" in lines[4]
    assert "malformed target entry" in lines[5] and "missing" in lines[5]


def test_stats_are_median_and_range_of_the_runs():
    s = report.stats([3.0, 1.0, None, 2.0, float("nan"), 10.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "runs": 4}
    assert report.fmt_stats(s, "{:.1f}") == "2.5 (1.0-10.0)"
    assert report.fmt_stats(report.stats([5.0])) == "5 (1 run)"
    assert report.stats([None]) == {} and report.fmt_stats({}) == "-"


def test_markdown_tables_are_collected_from_a_benchmark_output():
    out = ("load average 1.0\n| a | b |\n|---|---|\n| 1 | 2 |\n\nJSON: x\nwriter\n| c |\n|---|\n\n| d |\n|---|\n"
           "| lone |\n")
    got = report.markdown_tables(out)
    assert got == [{"caption": "load average 1.0", "lines": ["| a | b |", "|---|---|", "| 1 | 2 |"]},
                   {"caption": "writer", "lines": ["| c |", "|---|"]},
                   {"caption": "", "lines": ["| d |", "|---|", "| lone |"]}]


def test_peak_rss_sees_an_allocation_made_inside_the_block():
    big = np.ones(40 * 2**20 // 8)  # 40 MB before the block: not this row's peak
    del big
    with PeakRSS() as mem:
        a = np.ones(64 * 2**20 // 8)  # 64 MB touched
        a += 1
        time.sleep(0.1)  # long enough for the sampling fallback to see it
        del a
    assert mem.method in ("VmHWM", "sampled", "ru_maxrss")
    assert mem.peak_mb - mem.start_mb >= 50, (mem.method, mem.start_mb, mem.peak_mb)


def test_only_run_keeps_the_other_sections_with_their_own_header(tmp_path):
    from benchmarks import run_all

    old = _committed()
    (tmp_path / "results.json").write_text(json.dumps(old))
    run = dict(old["benchmarks"]["mixture"]["run"], command="python -m benchmarks.run_all --only mixture")
    new = {"command": run["command"], "quick": True, "runs": 3, "machine": run["machine"], "loadavg_end": [1, 1, 1],
           "benchmarks": {"mixture": dict(old["benchmarks"]["mixture"], run=run)}}
    run_all.keep_earlier_sections(new, tmp_path / "results.json")
    assert set(new["kept_from_earlier_runs"]) == {"loaders", *old["benchmarks"]} - {"mixture"}
    assert list(new["benchmarks"]) == [n for n in run_all.BENCHES if n in new["benchmarks"]]
    b = tables.blocks(new)
    assert b["mixture"].startswith("Measured with `python -m benchmarks.run_all --only mixture`")
    measured_by = (old["benchmarks"]["tokens"].get("run") or {}).get("command", old["command"])
    assert b["tokens"].startswith(f"Measured with `{measured_by}`")  # kept: the run that measured it
    assert "Kept from earlier runs" in b["targets"]


def test_run_process_reports_the_benchmark_peak_rss_and_stops_it_at_the_timeout(tmp_path):
    from benchmarks.run_all import run_process

    grow = "import numpy as np; a = np.ones(100 * 2**20 // 8); a += 1; print('| x |'); print('|---|')"
    r = run_process([sys.executable, "-c", grow], tmp_path / "a.log", timeout=120)
    assert r["rc"] == 0 and not r["timed_out"] and r["peak_rss_mb"] >= 100, r
    assert report.markdown_tables((tmp_path / "a.log").read_text()) == [{"caption": "", "lines": ["| x |", "|---|"]}]
    t0 = time.perf_counter()
    r = run_process([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "b.log", timeout=1)
    assert r["timed_out"] and r["rc"] == -9 and time.perf_counter() - t0 < 300, r  # killed, not waited out (60 s)
