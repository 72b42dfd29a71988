"""How the invalid-input suite (test_invalid_calls.py) judges one refusal.

A call with invalid input must raise one of the error types its case allows (a ValueError or
TypeError unless said otherwise), raised by jax_ub's own code (the innermost frame of the
traceback is a file of the jax_ub package: not jax's, XLA's, Python's or the test's), within
:data:`HANG_S` seconds, with a message that shows what was received (one of ``received``: a repr,
a shape, a dtype or a type name) and what was expected (one of the ``expected`` words). A command
line must end with exit status 2 and say the same on stderr.

:data:`CALLS` counts the refusals checked by this pytest run (the suite asserts its total).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import signal
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import jax_ub

PACKAGE = Path(jax_ub.__file__).resolve().parent
HANG_S = 30  # far above any refusal (all happen before a kernel runs): a call still busy hangs
CALLS = {"checked": 0}


@dataclasses.dataclass(frozen=True)
class Case:
    """One invalid call: ``call()`` must be refused naming one of ``received`` and one of
    ``expected`` (case-insensitive), with one of ``errors``."""

    what: str
    call: Callable[[], Any]
    received: tuple[str, ...]
    expected: tuple[str, ...]
    errors: tuple[type[BaseException], ...] = (ValueError, TypeError)


def shown(value: Any) -> tuple[str, ...]:
    """The ways a message may show ``value``: its repr; for a number also its ``str``; for a
    container or other object also its type's name (``got list``); for a shape ``[2, 3]``; for a
    dtype its name."""
    if isinstance(value, str):
        return (repr(value),)
    if isinstance(value, (bool, np.bool_)):
        return (repr(value),)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return (repr(value), str(value))
    if isinstance(value, np.dtype):
        return (value.name,)
    return (repr(value), type(value).__name__)


def shape_text(shape: Sequence[int]) -> str:
    """``(3, 5)`` -> ``[3, 5]``, as jax_ub's messages write shapes."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def message_problem(message: str, received: Sequence[str], expected: Sequence[str]) -> str | None:
    """What the message lacks (None: it shows what was received and says what was expected)."""
    if not any(r and r in message for r in received):
        return f"shows none of what was received {tuple(received)}"
    low = message.lower()
    if not any(w.lower() in low for w in expected):
        return f"says none of what was expected {tuple(expected)}"
    return None


@contextlib.contextmanager
def deadline(seconds: int, what: str) -> Iterator[None]:
    """A call that runs longer than ``seconds`` fails as a hang (SIGALRM: the main thread)."""

    def hang(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{what}: still running after {seconds} s (a hang, not a refusal)")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _raised_in(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return frames[-1].filename if frames else "?"


def refuse(case: Case) -> BaseException:
    """Runs ``case.call()`` and checks its refusal (see the module doc); returns the error."""
    try:
        with deadline(HANG_S, case.what):
            case.call()
    except case.errors as e:
        err: BaseException = e
    except BaseException as e:
        raise AssertionError(
            f"{case.what}: raised {type(e).__name__} from {_raised_in(e)}, not a jax_ub "
            f"{' or '.join(t.__name__ for t in case.errors)}: {e}"
        ) from e
    else:
        raise AssertionError(f"{case.what}: accepted (no error raised)")
    origin = Path(_raised_in(err)).resolve()
    assert PACKAGE in origin.parents, (
        f"{case.what}: {type(err).__name__} raised in {origin}, not by jax_ub's own checks: {err}"
    )
    problem = message_problem(str(err), case.received, case.expected)
    assert problem is None, f"{case.what}: the message {str(err)!r} {problem}"
    CALLS["checked"] += 1
    return err


def refuse_cli(
    what: str,
    main: Callable[[list[str]], Any],
    argv: list[str],
    received: Sequence[str],
    expected: Sequence[str],
) -> str:
    """``main(argv)`` (a command's entry point, in this process) ends with exit status 2 (its
    return value, or SystemExit's code) and stderr that shows one of ``received`` and one of
    ``expected``; returns stderr."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with deadline(HANG_S, what), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        raise AssertionError(f"{what}: main({argv!r}) raised {type(e).__name__}: {e}") from e
    text = err.getvalue()
    assert code == 2, f"{what}: main({argv!r}) ended with {code!r}, not 2; stderr {text!r}"
    problem = message_problem(text, received, expected)
    assert problem is None, f"{what}: stderr {text!r} {problem}"
    CALLS["checked"] += 1
    return text
