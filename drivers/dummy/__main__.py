"""`python -m drivers.dummy --listen unix:PATH` serves the dummy driver."""

from drivers.dummy.cli import main

if __name__ == "__main__":
    main()
