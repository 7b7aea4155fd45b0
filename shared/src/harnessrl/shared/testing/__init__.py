"""Pytest fixtures shared by every package's tests (loaded through the pytest11 entry point)."""
