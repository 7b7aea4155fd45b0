"""`python -m harnessrl.reward`: run a reward worker until SIGINT/SIGTERM."""

import sys

from harnessrl.reward.app import main

sys.exit(main())
