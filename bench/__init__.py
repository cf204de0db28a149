"""Scale benchmarks (issue 11): `python bench/run.py --help`."""
