"""The `wafer` command line (`host.cli.main`): build, run, dev, drivers, serve, and the engines
the commands start."""
