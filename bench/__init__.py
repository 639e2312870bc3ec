"""The benchmarks: each module measures and writes its figures as JSON (`python -m bench.<name> --json PATH`);
bench/report.py (`python -m bench.report`, `make bench`) runs them and writes BENCHMARKS.md. Run from the
repository root, so that `bench` and `harness` (what the benchmarks share with the tests) are importable."""
