"""`python -m host.cli ...`: the `wafer` command."""

import sys

from host.cli import main

sys.exit(main())
