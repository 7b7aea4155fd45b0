"""harnessrl.stack: the `harnessrl` command and everything that runs the system on one machine.

The local stack (nats-server, vLLM and every service as supervised processes), `train`/`follow`
and the demo. It imports the services to build their settings; no service imports it.
"""
