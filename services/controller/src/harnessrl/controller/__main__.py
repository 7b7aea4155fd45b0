"""`python -m harnessrl.controller [--config FILE]` runs the controller service."""

import sys

from harnessrl.controller.app import main

sys.exit(main())
