"""harnessrl controller service."""
