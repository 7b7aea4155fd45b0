"""harnessrl trainer service."""
