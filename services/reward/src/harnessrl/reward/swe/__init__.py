"""SWE-bench-style grading: patch application, test-file reset, sandboxed pytest, resolution."""
