"""tinyswe: an offline, SWE-bench-shaped task set built from small libraries we wrote.

Each library (a text bundle under `libraries/`) is a stdlib-only Python package with a pytest
suite. Bugs come from AST mutations and from hand-written edits with issue-style statements; a
candidate is kept only when its failing tests are few, some tests still pass and three pytest runs
agree. `build_tinyswe` writes one git repository per library plus `instances.jsonl`.
"""
