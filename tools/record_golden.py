"""Record the golden corpus of issue 29 (tests/golden/corpus.py) on this checkout: build its input files in a
temporary folder, serve them over HTTP (aiohttp's static handler, Range requests), run every configuration and
write ``tests/golden/batches.json`` (one SHA-256 of the batches and one of the states per configuration, and the
commit they were recorded on). Run it on a commit BEFORE a refactor; ``tests/test_golden.py`` then checks that
every later commit gives the same hashes.

    .venv/bin/python tools/record_golden.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "golden")]

import corpus  # noqa: E402  (tests/golden/corpus.py)
from remote_servers import StaticHTTP  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "batches.json"))
    args = ap.parse_args(argv)
    names = args.only or list(corpus.CONFIGS)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"], capture_output=True,
                           text=True).stdout.strip()
    out = Path(args.out)
    recorded = json.loads(out.read_text()) if out.is_file() else {"configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus.build(tmp)
        with StaticHTTP(tmp) as http:
            for name in names:
                t0 = time.perf_counter()
                recorded["configs"][name] = corpus.run(name, files, http.url)
                print(f"{name:32s} {recorded['configs'][name]['steps']:4d} batches  {time.perf_counter() - t0:6.1f} s")
    recorded["commit"] = commit.strip() + (" (src/ modified)" if dirty else "")
    recorded["configs"] = dict(sorted(recorded["configs"].items()))
    out.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {out} ({len(recorded['configs'])} configurations)")


if __name__ == "__main__":
    main()
