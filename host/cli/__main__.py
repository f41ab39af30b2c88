"""`python -m host.cli ...`: the `wafer` command."""

import sys

from host.cli.main import main

sys.exit(main())
