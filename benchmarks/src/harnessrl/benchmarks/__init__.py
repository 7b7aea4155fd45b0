"""The `make bench-<name>` programs: `python -m harnessrl.benchmarks <name>` runs one.

Each benchmark is the module `harnessrl.benchmarks.<name>` with a `main()`; its last stdout line is
one JSON object. Benchmarks may import every other package (services, the stack, the test kit); no
product package imports a benchmark.
"""

NAMES = ("bus", "gateway", "reward", "controller", "trainer", "scale", "cluster_check", "merge")
