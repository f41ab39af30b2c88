"""What the build wires to the component's `run` export: call the inferlet's `main(args)` and turn
an uncaught exception into the run's error, with the guest traceback in it."""

from __future__ import annotations

import traceback
from collections.abc import Callable

from componentize_py_types import Err

from inferlet.errors import InferletError
from inferlet.runtime import args


def run_main(main: Callable[[list[str]], object]) -> None:
    try:
        main(args())
    except InferletError as e:
        raise Err(str(e)) from None
    except Err:
        raise
    except BaseException:  # the host must get the traceback, whatever it was
        raise Err(traceback.format_exc()) from None
