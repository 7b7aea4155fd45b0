"""Benchmarks: `python -m harnessrl.benchmarks <name>` runs one (entry point group `harnessrl.benchmarks`)."""
