"""A test inferlet that writes to the host's log without bound, as a hostile tenant would:
`log LINES CHARS` through `runtime.log`, `print LINES CHARS` on stdout and stderr."""

import sys

from inferlet import emit, log


def main(args: list[str]) -> None:
    what, count, line = args[0], int(args[1]), "x" * int(args[2])
    for _ in range(count):
        if what == "log":
            log(line)
        else:
            print(line)
            print(line, file=sys.stderr)
    emit("done")
