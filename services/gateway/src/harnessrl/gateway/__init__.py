"""harnessrl gateway service."""
