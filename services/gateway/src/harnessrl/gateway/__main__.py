"""`python -m harnessrl.gateway [--config ...]`: run the gateway."""

from harnessrl.gateway.cli import main

main()
