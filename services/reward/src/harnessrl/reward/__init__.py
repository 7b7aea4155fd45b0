"""harnessrl reward service."""
