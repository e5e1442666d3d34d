"""The benchmark sections ``benchmarks.run_all`` runs and ``benchmarks.tables`` writes README tables for: data
only (no imports), so that the runner and the table writer both read it and neither imports the other."""

# python -m benchmarks.<name>: settings per mode as (flag, values...); a flag the script does not define is left
# out (the script's own default applies, noted in the result). A script that defines --quick gets only --quick.
BENCHES = {
    "images": {"quick": [("--images", "320")], "full": [], "timeout": 3600},
    "tokens": {"quick": [("--tokens", "2000000"), ("--memory-mb", "16"), ("--seconds", "0.2"), ("--skip-write",)],
               "full": [], "timeout": 3600},
    "write": {"quick": [("--images", "200"), ("--workers", "1", "2"), ("--no-dask",), ("--no-tokens",)],
              "full": [], "timeout": 3600},
    "mixture": {"quick": [("--images", "64"), ("--tokens", "2000000"), ("--min-seconds", "0.2")],
                "full": [("--repeats", "9")], "timeout": 3600},
    "producer_consumer": {"quick": [("--images", "320"), ("--steps", "12"), ("--target-step-ms", "10", "50")],
                          "full": [], "timeout": 1800},
    "manyfile_scale": {"quick": [], "full": [], "timeout": 3600},
    "remote": {"quick": [("--images", "640"), ("--latencies", "0,50"), ("--orders", "quasi_random"),
                         ("--au-probes", "0"), ("--no-tokens",), ("--peers", "")],
               "full": [], "timeout": 7200, "chart": "--chart"},
    "cold_start": {"quick": [("--no-warmup",)], "full": [], "timeout": 3600},
    "trainer_cost": {"quick": [], "full": [], "timeout": 1800},
    "packing": {"quick": [], "full": [], "timeout": 1800},
    "multimodal": {"quick": [], "full": [], "timeout": 1800},
}
SECTIONS = ["loaders", *BENCHES]
