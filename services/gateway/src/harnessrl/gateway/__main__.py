"""`python -m harnessrl.gateway [--config FILE] [flags]`: run the gateway."""

import sys

from harnessrl.gateway.app import main

sys.exit(main())
