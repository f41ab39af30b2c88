"""`python -m host.daemon`: run the daemon (the same as `wafer serve`)."""

from __future__ import annotations

import sys

from host.daemon.cli import main

sys.exit(main())
