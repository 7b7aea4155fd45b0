"""harnessrl.testkit: test doubles and fixtures for tests and benchmarks only.

The fake Kubernetes API, canned upstreams, the reward stub, the artifact sink, scripted span
sequences, the pytest plugin and test secrets. Installed by `make dev`; in no service's dependencies
and in no image; no product module imports it.
"""
