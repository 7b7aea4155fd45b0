"""`python -m harnessrl.trainer [--config FILE] [flags]`: run the trainer service."""

import sys

from harnessrl.trainer.app import main

sys.exit(main())
