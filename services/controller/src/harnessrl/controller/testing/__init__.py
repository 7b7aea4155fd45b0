"""Test doubles for what cannot run on a build machine (a Kubernetes API server)."""
