#!/usr/bin/env python
"""Run a Python program as ``python`` would, but end it at once when it fails.

    python examples/failfast.py script.py [args...]
    python examples/failfast.py -m package.module [args...]
    python examples/failfast.py -c "code" [args...]

After ``jax.distributed.initialize()``, a process whose program raises or calls ``sys.exit(N)``
with N != 0 does not exit: the interpreter first runs its atexit handlers, and jax's calls
``jax.distributed.shutdown()``, whose barrier waits for every other process (up to
``shutdown_timeout_seconds``, 300 s by default). Meanwhile the other processes wait for the failed
one in a collective, and a launcher sees no failure because the process is still alive
(examples/launch.sh stops the others only when one exits non-zero).

Here a failed program has its traceback printed (through ``sys.excepthook``), stdout and stderr
flushed, and ends with ``os._exit(status)``: 1 for an exception, 130 for KeyboardInterrupt, N for
``sys.exit(N)``. The atexit handlers are skipped, the program's own included. A program that
succeeds (returns, ``sys.exit(0)``, ``sys.exit()``) exits as usual, atexit handlers and the
``jax.distributed.shutdown()`` barrier included.

examples/launch.sh runs every process through this file (``LAUNCH_FAIL_FAST=0`` turns that off).
With srun or mpirun, put it before the script, or do the same in the script itself (see
examples/README.md and ``main()`` in examples/train_tp_block.py).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

USAGE = (
    "usage: failfast.py SCRIPT.py [ARGS...]  |  failfast.py -m MODULE [ARGS...]  |  "
    "failfast.py -c CODE [ARGS...]"
)


def leave_now(status: int) -> NoReturn:
    """Flush stdout and stderr, then end the process without atexit handlers."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _report(exc: BaseException) -> None:
    """The traceback as Python would print it, without this file's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    exc = exc.with_traceback(tb)  # the default hook prints exc.__traceback__, not its argument
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # a broken user hook must not keep the process alive
        traceback.print_exception(type(exc), exc, tb)


def _program(argv: list[str]) -> Callable[[], object]:
    """How to run ``argv`` (a script, ``-m module`` or ``-c code``) as ``__main__``; sets sys.argv
    and sys.path[0] as the interpreter does for ``python argv...``, and exits 2 as it does for a
    script it cannot open."""
    if not argv or (argv[0] in ("-m", "-c") and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    if argv[0] == "-c":
        code = argv[1]
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""  # the current directory, as for python -c
        main_globals = {"__name__": "__main__", "__builtins__": __builtins__}
        return lambda: exec(compile(code, "<string>", "exec"), main_globals)
    if argv[0] == "-m":
        module = argv[1]
        sys.argv = [module, *argv[2:]]  # run_module(alter_sys=True) puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        return lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)
    if argv[0].startswith("-"):
        print(f"{USAGE}\n(interpreter options such as {argv[0]!r} go before failfast.py)", file=sys.stderr)
        sys.exit(2)
    script = argv[0]
    if not os.path.exists(script):
        print(
            f"{sys.executable}: can't open file {os.path.abspath(script)!r}: [Errno 2] No such file or "
            f"directory",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    return lambda: runpy.run_path(script, run_name="__main__")


def main() -> None:
    run = _program(sys.argv[1:])
    try:
        run()
    except SystemExit as e:
        code = e.code
        if code is None or code == 0:
            raise  # success: exit as usual
        if not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
            print(code, file=sys.stderr)
            code = 1
        leave_now(code)
    except BaseException as e:
        _report(e)
        leave_now(130 if isinstance(e, KeyboardInterrupt) else 1)


if __name__ == "__main__":
    main()
