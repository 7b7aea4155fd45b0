"""`python -m harnessrl.trainer [--config ...]`: run the trainer service."""

from harnessrl.trainer.cli import main

main()
