"""Every jax_ub setting in one place.

Each field of :class:`Config` has an environment variable (``JAX_UB_*``; empty or blank is unset)
that sets its default; :func:`get` returns the active configuration and :func:`override` changes it
for a ``with`` block (tests, benchmarks). Nothing else in the package reads ``os.environ``.

Each field carries its documentation as metadata (variable, values, meaning; :func:`settings`), from
which ``docs/configuration.md`` is generated: ``python -m jax_ub.config --markdown
docs/configuration.md`` rewrites it. The schedule experiments are read from ``JAX_UB_EXPERIMENTAL_*``
variables, with no compatibility promise; their former names (:data:`DEPRECATED_VARIABLES`) are
still read, with a warning, until the next release.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import logging
import math
import numbers
import os
import sys
import textwrap
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jax_ub.methods import METHODS

if sys.argv[:1] == ["-m"]:
    # `python -m jax_ub.config`: importing the package imports this module first, which runpy then
    # warns about before running the file again as __main__; harmless, __main__ calls this module.
    warnings.filterwarnings(
        "ignore", message=r"'jax_ub\.config' found in sys\.modules", category=RuntimeWarning
    )

# JAX_UB_* variables that are not settings of this module, and what they are.
OTHER_VARIABLES = {
    "JAX_UB_CUDA_ARCHS": "the CUDA architectures the build compiles for (`CMakeLists.txt`)",
    "JAX_UB_REQUIRE_CUDA": "`1` makes the build fail instead of installing without the CUDA extension "
    "(`CMakeLists.txt`, CI)",
    "JAX_UB_ALLOW_NO_CUDA": "`1` lets an install on a machine with an NVIDIA driver go on without the CUDA "
    "extension where it cannot be built (`build_backend/jax_ub_backend.py`)",
    "JAX_UB_BUILD_CUDA": "the CUDA version the build compiles for (`13`, `13.0`), as `-C cuda=...`; by "
    "default the NVIDIA driver's (`build_backend/jax_ub_backend.py`)",
    "JAX_UB_CI_VENV": "where CI (`.ci/run`) keeps its virtual environment",
}
OTHER_PREFIXES = ("JAX_UB_TEST_",)  # the test launcher's, to its worker processes
EXPERIMENTAL_PREFIX = "JAX_UB_EXPERIMENTAL_"
# Variables still recognised that do nothing, and what their warning says; they go next release.
INERT_VARIABLES = {
    "JAX_UB_MULTICAST": "does nothing (jax_ub has no NVLink multicast path) and will be removed",
    "UB_SKIPMC": "does nothing in jax_ub (it has no multicast path to turn off); jax_ub will stop reading it",
}
BOOTSTRAPS = ("auto", "kv", "nccl")
TRANSPORTS = ("auto", "ipc", "nccl")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
CHAIN_SPLITS = ("auto", "rows", "cols")
ON_STALL = ("abort", "wait")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {_TRUE + _FALSE[:-1]}; got {value!r}")


def _parse_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    v = value.strip().lower()
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")
    return v


_NUMBER_NAMES = {int: "an integer", float: "a number"}


# The shortest bound on a wait for a peer, in seconds (JAX_UB_TIMEOUT, Config and initialize).
MIN_TIMEOUT_S = 1e-3
# The longest (one week): a longer one is a typo, and overflows the waits that count in integer
# milliseconds (jax.distributed's key-value store: a 32-bit count, 24.8 days) or nanoseconds.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# buffer_mib / gemm_workspace_mib above this (1 TiB) are typos, not memory a GPU has: refused by
# name here, not left to overflow a size in the extension.
MAX_MIB = 1 << 20


def _parse_number(name: str, value: str, kind: type, minimum: float) -> float | int:
    try:
        out = kind(value)
    except ValueError:
        raise ValueError(f"{name} must be {_NUMBER_NAMES[kind]}; got {value!r}") from None
    if not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value!r}")
    return out


def _bounded_int(name: str, value: str, maximum: int, unit: str = "") -> int:
    out = int(_parse_number(name, value, int, 0))
    if out > maximum:
        raise ValueError(f"{name} must be <= {maximum}{unit}; got {value!r}")
    return out


def _parse_log_level(name: str, value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"{name} must be DEBUG, INFO, WARNING or ERROR; got {value!r}")
    return level


# ------------------------------------------------------------------------------------------------
# What a setting's values are: how its variable is read (errors name the variable), how a value set
# in Python is checked and put in normal form (errors name the field), how the docs name them.


class _Kind:
    def parse(self, var: str, text: str) -> Any:
        raise NotImplementedError

    def check(self, name: str, value: Any) -> Any:
        return value

    def values(self) -> str:
        raise NotImplementedError


class _Bool(_Kind):
    def parse(self, var: str, text: str) -> bool:
        return _parse_bool(var, text)

    def values(self) -> str:
        return "`0` or `1` (also `false`/`true`, `no`/`yes`, `off`/`on`)"


@dataclasses.dataclass(frozen=True)
class _Choice(_Kind):
    choices: tuple[str, ...]

    def parse(self, var: str, text: str) -> str:
        return _parse_choice(var, text, self.choices)

    def check(self, name: str, value: str) -> str:
        return _parse_choice(name, value, self.choices)

    def values(self) -> str:
        return ", ".join(f"`{c}`" for c in self.choices)


@dataclasses.dataclass(frozen=True)
class _Int(_Kind):
    maximum: int
    unit: str = ""  # after the bound in the variable's error: " (SMs)"
    note: str = ""  # after the range in the field's error
    noun: str = ""  # after the range in the docs: "MiB"

    def parse(self, var: str, text: str) -> int:
        return _bounded_int(var, text, self.maximum, self.unit)

    def check(self, name: str, value: int) -> int:
        if not 0 <= value <= self.maximum:
            raise ValueError(f"{name} must be in [0, {self.maximum}]{self.note}; got {value!r}")
        return value

    def values(self) -> str:
        return f"integer, 0 to {self.maximum}" + (f" ({self.noun})" if self.noun else "")


class _Seconds(_Kind):
    def parse(self, var: str, text: str) -> float:
        out = float(_parse_number(var, text, float, MIN_TIMEOUT_S))
        if out > MAX_TIMEOUT_S:
            raise ValueError(f"{var} must be <= {MAX_TIMEOUT_S:g} (seconds: one week); got {text!r}")
        return out

    def check(self, name: str, value: float) -> float:
        if not (math.isfinite(value) and value >= MIN_TIMEOUT_S):
            raise ValueError(f"{name} must be a finite number >= {MIN_TIMEOUT_S} (seconds); got {value!r}")
        if value > MAX_TIMEOUT_S:
            raise ValueError(f"{name} must be <= {MAX_TIMEOUT_S:g} (seconds: one week); got {value!r}")
        return value

    def values(self) -> str:
        return f"seconds, a number from {MIN_TIMEOUT_S} to {MAX_TIMEOUT_S:g} (one week)"


class _Level(_Kind):
    def parse(self, var: str, text: str) -> str:
        return _parse_log_level(var, text)

    def check(self, name: str, value: str) -> str:
        level = value.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"{name} must be one of {LOG_LEVELS}; got {value!r}")
        return level

    def values(self) -> str:
        return ", ".join(f"`{v}`" for v in LOG_LEVELS) + " (any case)"


class _Path(_Kind):
    def parse(self, var: str, text: str) -> str:
        return self.check(var, text.strip())

    def check(self, name: str, value: str) -> str:
        if "\0" in value:  # no file system takes it: open() would fail later, naming no setting
            raise ValueError(f"{name} must be a path (without NUL characters); got {value!r}")
        return value

    def values(self) -> str:
        return "a path"


_MIB = _Int(MAX_MIB, " (MiB: 1 TiB)", f" (MiB; {MAX_MIB} is 1 TiB)", "MiB")
_SMS = _Int(256, " (SMs)", "", "SMs")


def _setting(default: Any, env: str, kind: _Kind, doc: str, deprecated_env: str = "") -> Any:
    """A field of :class:`Config`: read from ``env`` (and from its former name ``deprecated_env``,
    with a warning), its values ``kind``, its meaning ``doc`` (one paragraph, Markdown)."""
    return dataclasses.field(
        default=default,
        metadata={"env": env, "kind": kind, "doc": " ".join(doc.split()), "deprecated_env": deprecated_env},
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """jax_ub's settings; each field's metadata documents it (:func:`settings`)."""

    method: str = _setting(
        "auto",
        "JAX_UB_METHOD",
        _Choice(METHODS),
        """
        Which implementation every jax_ub op runs. `auto` chooses per call from measured times (those
        of `JAX_UB_TUNING_FILE`, else the ones shipped with jax_ub; `jax_ub.explain` says what it
        chose and why); `xla` runs the pure-XLA reference; the others name a CUDA algorithm. A method
        of the other op runs its counterpart: for the AG→GEMM, `chain` and `columns` run `push` and
        `pipeline` runs `ring`; for the GEMM→RS, `all_peer` runs `pipeline`, and `push` and
        `push_merge` run `ring`. `nccl` needs the `nccl` transport.""",
    )
    auto_chain: bool = _setting(
        False,
        "JAX_UB_AUTO_CHAIN",
        _Bool(),
        """
        `1` lets `auto` choose `chain` at tp >= 3 in bfloat16 or float16, whose partial sums travel in
        the op's dtype (one rounding per hop, where every other method sums in fp32). With `0`, where
        `chain` measured fastest, `auto` runs the fastest of the others.""",
    )
    disable: bool = _setting(
        False,
        "JAX_UB_DISABLE",
        _Bool(),
        """
        `1` runs the pure-XLA reference path for every op, on every device.""",
    )
    allow_reference: bool = _setting(
        False,
        "JAX_UB_ALLOW_REFERENCE",
        _Bool(),
        """
        `1` lets `method="auto"` run the pure-XLA reference path on a mesh of CUDA GPUs where jax_ub's
        CUDA path cannot run (the extension is not built or does not load, the driver is too old, no
        `jax_ub.initialize` for the mesh axis). With `0` the first such op raises, naming the reason
        and the fix, rather than running at XLA's speed unnoticed. On CPU and TPU meshes the reference
        is the normal path either way.""",
    )
    timeout_s: float = _setting(
        120.0,
        "JAX_UB_TIMEOUT",
        _Seconds(),
        """
        How long any wait for a peer may go without progress, counted while this GPU is inside the
        op, before the op fails naming that peer. Also the default `timeout_s` of
        `jax_ub.initialize`.""",
    )
    on_stall: str = _setting(
        "abort",
        "JAX_UB_ON_STALL",
        _Choice(ON_STALL),
        """
        What follows a timeout whose release has not reached the GPU 10 s later (its command queue is
        stalled, so the XLA call can never return): `abort` ends the process after printing why;
        `wait` prints and keeps hanging (for a debugger).""",
    )
    bootstrap: str = _setting(
        "auto",
        "JAX_UB_BOOTSTRAP",
        _Choice(BOOTSTRAPS),
        """
        How `initialize` passes the GPUs' buffer handles between processes: `kv` through
        `jax.distributed`'s key-value store; `nccl` sends an NCCL unique id through that store and the
        handles by an NCCL all-gather. `auto` is `kv`. A single process needs no exchange.""",
    )
    transport: str = _setting(
        "auto",
        "JAX_UB_TRANSPORT",
        _Choice(TRANSPORTS),
        """
        How data moves between GPUs: `ipc` copies over peer-mapped memory with the copy engine (no
        SMs); `nccl` uses `ncclSend`/`ncclRecv` and also works across hosts. `auto` takes `ipc` where
        every GPU pair of each group can map each other's memory, else `nccl`, and logs why. With one
        process per GPU, a GPU that `CUDA_VISIBLE_DEVICES` hides from a process is checked through
        NVML; a pair nobody can check makes `auto` take `nccl`.""",
    )
    buffer_mib: int = _setting(
        0,
        "JAX_UB_BUFFER_MIB",
        _MIB,
        """
        The registered communication buffer per GPU allocated at `initialize`; `0` starts without one
        and grows it when a traced op needs more.""",
    )
    gemm_workspace_mib: int = _setting(
        32,
        "JAX_UB_GEMM_WORKSPACE_MIB",
        _MIB,
        """
        The cuBLASLt workspace of each GEMM call.""",
    )
    gemm_tune: int = _setting(
        8,
        "JAX_UB_GEMM_TUNE",
        _Int(16, " (cuBLASLt candidates)"),
        """
        How many cuBLASLt candidate algorithms are timed per GEMM shape when it is first traced (on
        random data, after GEMMs that bring the GPU to its sustained clocks); another than the
        heuristic's first is kept only where it is more than 3% faster. It costs a fraction of a
        second per GEMM shape and GPU at the first trace. Being timed, like XLA's autotuning, the
        kept algorithm (and so the last bits of a result) can differ between runs: `0` or `1` keeps
        the heuristic's first, for bitwise-repeatable runs.""",
    )
    recompute_gathered: bool = _setting(
        False,
        "JAX_UB_RECOMPUTE_GATHERED",
        _Bool(),
        """
        `1`: `all_gather_matmul` keeps only the local shard of x for its backward, not the tp times
        larger gathered x, and gathers it again there under the dgrad GEMM. Per call:
        `recompute_gathered=`. No effect with `return_gathered=True`.""",
    )
    tuning_file: str = _setting(
        "",
        "JAX_UB_TUNING_FILE",
        _Path(),
        """
        A bench JSON of this machine (from `python -m jax_ub.bench tune SHAPES.json`, or
        `python -m jax_ub.bench ag` or `rs`): for the op, tp and dtype it measured, `auto` chooses
        from its records; for the others, from the ones shipped with jax_ub.""",
    )
    record_shapes: str = _setting(
        "",
        "JAX_UB_RECORD_SHAPES",
        _Path(),
        """
        A JSON file to which each jax_ub op traced in this process adds its shape (and its
        backward's), rewritten at every traced op, for `python -m jax_ub.bench tune`. With several
        processes each writes `<stem>.process<i>.json`; a process that recorded nothing says so at
        exit.""",
    )
    log_level: str = _setting(
        "WARNING",
        "JAX_UB_LOG",
        _Level(),
        """
        The level of the `jax_ub` logger. When the variable is set, its records are printed on stderr
        unless logging is configured already.""",
    )
    # Schedule experiments (JAX_UB_EXPERIMENTAL_*): knobs for measuring the CUDA methods' schedules.
    bulk_reduce_sms: int = _setting(
        0,
        "JAX_UB_EXPERIMENTAL_BULK_REDUCE_SMS",
        _SMS,
        """
        SMs that `bulk_reduce_scatter` keeps from its concurrent GEMM for the fp32 sum; `0` gives the
        GEMM every SM, and the sum runs after it at full speed.""",
        "JAX_UB_BULK_REDUCE_SMS",
    )
    bulk_copy_sms: int = _setting(
        8,
        "JAX_UB_EXPERIMENTAL_BULK_COPY_SMS",
        _SMS,
        """
        SMs that `bulk_all_gather`'s GEMM leaves, over its first rows, to the gather's same-device
        copies (publish, own rows), which then start at once beside it; `0` gives the GEMM every SM,
        and it waits for those copies.""",
        "JAX_UB_BULK_COPY_SMS",
    )
    rs_chain_pieces: int = _setting(
        0,
        "JAX_UB_EXPERIMENTAL_RS_CHAIN_PIECES",
        _Int(4),
        """
        Pieces per step of the `chain` GEMM→RS, each piece's partial sum sent on while the next is
        computed; `0` lets jax_ub choose.""",
        "JAX_UB_RS_CHAIN_PIECES",
    )
    rs_chain_split: str = _setting(
        "auto",
        "JAX_UB_EXPERIMENTAL_RS_CHAIN_SPLIT",
        _Choice(CHAIN_SPLITS),
        """
        How `chain` cuts a step into pieces: `rows`, or `cols` (column blocks: each piece's GEMM reads
        only its block of w, so w is read once per step). `auto` cuts columns where the output is
        narrow enough, rows above.""",
        "JAX_UB_RS_CHAIN_SPLIT",
    )
    rs_column_pieces: int = _setting(
        0,
        "JAX_UB_EXPERIMENTAL_RS_COLUMN_PIECES",
        _Int(8),
        """
        Column blocks of the `columns` GEMM→RS; `0` lets jax_ub choose.""",
        "JAX_UB_RS_COLUMN_PIECES",
    )
    rs_pieces: int = _setting(
        0,
        "JAX_UB_EXPERIMENTAL_RS_PIECES",
        _Int(8),
        """
        Row pieces of a bare reduce-scatter (`jax_ub.overlap.reduce_scatter`): each piece is summed as
        soon as every peer's piece has landed, so only the last piece's sum follows the last copy.
        `0`: one piece per fixed number of bytes that a peer receives, up to a bound.""",
        "JAX_UB_RS_PIECES",
    )
    ag_push_pieces: int = _setting(
        0,
        "JAX_UB_EXPERIMENTAL_AG_PUSH_PIECES",
        _Int(4),
        """
        Row pieces of the last peer chunk of the `push` AG→GEMM, so that the op ends one piece's GEMM
        after the last copy; `0` lets a model of the schedule choose (more than one piece only where a
        chunk's copy outlasts its GEMM).""",
        "JAX_UB_AG_PUSH_PIECES",
    )
    ag_push_merge: bool = _setting(
        False,
        "JAX_UB_EXPERIMENTAL_AG_PUSH_MERGE",
        _Bool(),
        """
        `1`: every call of the `push` AG→GEMM (without pieces, tp > 2) multiplies the peers' chunks
        as at most two GEMMs over their contiguous rows, each once its chunks have landed, instead of
        one GEMM per chunk. The method `push_merge` runs this, and `auto` chooses it where it measured
        fastest.""",
        "JAX_UB_AG_PUSH_MERGE",
    )

    def __post_init__(self) -> None:
        # Values set directly (Config(...), override(...)) get from_env's checks and normal form:
        # a wrong type is a TypeError naming the field here, not a failure somewhere later.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"{f.name} must be a bool; got {value!r}")
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise TypeError(f"{f.name} must be an int; got {value!r}")
                object.__setattr__(self, f.name, int(value))
            if f.type == "float":
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise TypeError(f"{f.name} must be a number; got {value!r}")
                object.__setattr__(self, f.name, float(value))
            if f.type == "str" and not isinstance(value, str):
                raise TypeError(f"{f.name} must be a str; got {value!r}")
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["kind"].check(f.name, getattr(self, f.name)))

    @property
    def multicast(self) -> bool:
        """Always False: jax_ub has no NVLink multicast path (``JAX_UB_MULTICAST`` does nothing).
        Kept for readers of the former field, until that variable goes."""
        return False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """The configuration the ``JAX_UB_*`` variables of ``environ`` (default ``os.environ``) set.
        Every invalid value is named in one ValueError (one sentence each). A variable's former name
        (:data:`DEPRECATED_VARIABLES`) and a variable that does nothing (:data:`INERT_VARIABLES`)
        each get a WARNING on the ``jax_ub`` logger, and so does a ``JAX_UB_*`` name that is no
        setting, with the setting it most likely misspells."""
        env = os.environ if environ is None else environ
        kw: dict[str, object] = {}
        errors: list[str] = []
        notes: list[str] = []

        def is_set(var: str) -> bool:
            # Empty (or blank) is unset, for every variable (`JAX_UB_METHOD=${M:-}` in a script).
            return bool(env.get(var, "").strip())

        for s in settings():
            var = s.env
            if s.deprecated_env and is_set(s.deprecated_env):
                if is_set(s.env):
                    notes.append(f"{s.deprecated_env} ignored: {s.env}, its new name, is set as well")
                else:
                    notes.append(
                        f"{s.deprecated_env} is deprecated and read until the next release only: "
                        f"set {s.env} instead (experimental: no compatibility promise)"
                    )
                    var = s.deprecated_env
            if is_set(var):
                try:
                    kw[s.field] = s.kind.parse(var, env[var])
                except ValueError as e:
                    errors.append(str(e))
        notes += [f"{var} {why}" for var, why in INERT_VARIABLES.items() if is_set(var)]
        # A logged warning, not warnings.warn: these are read at the first op, not at an import of the
        # caller's, and Python's default filters hide a DeprecationWarning raised inside jax_ub.
        log = logging.getLogger("jax_ub")
        for note in notes:
            log.warning("jax_ub: %s", note)
        unknown = describe_unknown(env)
        if unknown:  # most likely a misspelt setting, which would otherwise change nothing silently
            log.warning("jax_ub: ignoring %s", "; ".join(unknown))
        if errors:
            raise ValueError(". ".join(errors))
        return cls(**kw)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of :class:`Config` as documented: its ``env`` variable, ``default``, ``values``
    (what the variable takes, in words), ``doc`` (one paragraph, Markdown), ``experimental`` (a
    ``JAX_UB_EXPERIMENTAL_*`` variable: no compatibility promise) and ``deprecated_env`` (the
    variable's former name, still read with a warning; "" if none)."""

    field: str
    env: str
    default: Any
    values: str
    doc: str
    experimental: bool
    deprecated_env: str
    kind: _Kind = dataclasses.field(repr=False, compare=False)


def settings() -> tuple[Setting, ...]:
    """Every field of :class:`Config` with its documentation, in the fields' order."""
    return tuple(
        Setting(
            f.name,
            f.metadata["env"],
            f.default,
            f.metadata["kind"].values(),
            f.metadata["doc"],
            f.metadata["env"].startswith(EXPERIMENTAL_PREFIX),
            f.metadata["deprecated_env"],
            f.metadata["kind"],
        )
        for f in dataclasses.fields(Config)
    )


_active: Config | None = None
_LOG_FORMAT = "%(levelname)s %(message)s"  # most messages start with "jax_ub: " themselves


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """The ``JAX_UB_*`` names in ``env`` that jax_ub does not know: none of :data:`KNOWN_VARIABLES`
    or :data:`OTHER_VARIABLES`."""
    return sorted(
        k
        for k in env
        if k.startswith("JAX_UB_")
        and k not in KNOWN_VARIABLES
        and k not in OTHER_VARIABLES
        and not k.startswith(OTHER_PREFIXES)
    )


def describe_unknown(env: Mapping[str, str]) -> list[str]:
    """Each of :func:`unknown_variables`, said with the setting it most likely misspells:
    ``"JAX_UB_METHD: not a jax_ub setting (did you mean JAX_UB_METHOD?)"``, or without a close
    one, ``"...: not a jax_ub setting (the settings: JAX_UB_METHOD, ...)"``."""
    out = []
    for k in unknown_variables(env):
        near = closest_setting(k)
        out.append(
            f"{k}: not a jax_ub setting ("
            + (f"did you mean {near}?)" if near else f"the settings: {', '.join(KNOB_VARIABLES)})")
        )
    return out


def _stem(name: str) -> str:
    return name.removeprefix("JAX_UB_").removeprefix("EXPERIMENTAL_")


def closest_setting(name: str) -> str | None:
    """The jax_ub variable ``name`` most likely misspells, or None."""
    # Compared without the shared "JAX_UB_" (which alone made JAX_UB_FOO look like JAX_UB_LOG) and
    # "EXPERIMENTAL_": JAX_UB_AG_MERGE and JAX_UB_EXPERIMENTAL_AG_MERG both mean the push merge.
    names = {_stem(v): v for v in (*KNOB_VARIABLES, *OTHER_VARIABLES)}
    near = difflib.get_close_matches(_stem(name), list(names), n=1, cutoff=0.6)
    return names[near[0]] if near else None


def _setup_logging(cfg: Config, from_env: bool) -> None:
    """Sets the ``jax_ub`` logger's level; with ``JAX_UB_LOG`` set and no handler that would print
    its records (Python's last resort prints WARNING and above only), adds one on stderr."""
    log = logging.getLogger("jax_ub")
    log.setLevel(cfg.log_level)
    if from_env and not log.hasHandlers():
        handler = logging.StreamHandler()  # stderr
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        log.addHandler(handler)


def get() -> Config:
    """The active configuration (read from the environment on first use)."""
    global _active
    if _active is None:
        _active = Config.from_env()
        _setup_logging(_active, from_env="JAX_UB_LOG" in os.environ)
    return _active


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Config]:
    """Temporarily replace fields of the active configuration: ``with override(method="xla"):``."""
    global _active
    previous = get()
    fields = [f.name for f in dataclasses.fields(Config)]
    unknown = sorted(k for k in changes if k not in fields)
    if unknown:  # dataclasses' own message ("unexpected keyword argument") names no field
        # JAX_UB_METHOD names the field method: compared without the prefix, in lower case.
        guesses = [
            (k, difflib.get_close_matches(k.lower().removeprefix("jax_ub_"), fields, n=1, cutoff=0.6))
            for k in unknown
        ]
        raise TypeError(
            "config.override: "
            + "; ".join(
                f"{k!r} is not a jax_ub setting" + (f" (did you mean {g[0]!r}?)" if g else "")
                for k, g in guesses
            )
            + f". The settings: {', '.join(fields)}"
        )
    _active = dataclasses.replace(previous, **changes)  # type: ignore[arg-type]
    if "log_level" in changes:
        logging.getLogger("jax_ub").setLevel(_active.log_level)
    try:
        yield _active
    finally:
        _active = previous
        if "log_level" in changes:
            logging.getLogger("jax_ub").setLevel(previous.log_level)


# Each setting's variable, in the fields' order.
KNOB_VARIABLES = tuple(s.env for s in settings())
# Former name -> the variable that replaces it (read, with a warning, until the next release).
DEPRECATED_VARIABLES = {s.deprecated_env: s.env for s in settings() if s.deprecated_env}
# Every variable from_env reads: the settings', their former names and the inert ones.
KNOWN_VARIABLES = (*KNOB_VARIABLES, *DEPRECATED_VARIABLES, *INERT_VARIABLES)


# ------------------------------------------------------------------------------------------------
# docs/configuration.md, generated from the settings' metadata.

DOCS_PATH = "docs/configuration.md"
REGENERATE = f"python -m jax_ub.config --markdown {DOCS_PATH}"


def _default_text(value: object) -> str:
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    return f"`{value}`" if value != "" else "(unset)"


def _paragraph(text: str) -> list[str]:
    return [*textwrap.wrap(" ".join(text.split()), 100, break_long_words=False, break_on_hyphens=False), ""]


def _settings_text(group: Sequence[Setting]) -> list[str]:
    out = ["| variable | field | default | values |", "|---|---|---|---|"]
    out += [
        f"| [`{s.env}`](#{s.env.lower()}) | `{s.field}` | {_default_text(s.default)} | {s.values} |"
        for s in group
    ]
    out.append("")
    for s in group:
        out += [f"### `{s.env}`", ""]
        line = f"Field `Config.{s.field}`. Default: {_default_text(s.default)}. Values: {s.values}."
        if s.deprecated_env:
            line += f" Formerly `{s.deprecated_env}`, still read (with a warning) until the next release."
        out += _paragraph(line) + _paragraph(s.doc)
    return out


def markdown() -> str:
    """The text of ``docs/configuration.md``: every setting, from the fields' metadata."""
    group = settings()
    out = [
        "# Configuration",
        "",
        f"<!-- Generated from jax_ub/config.py by `{REGENERATE}`: edit the settings' metadata there, "
        "not this file. -->",
        "",
    ]
    out += _paragraph(
        "jax_ub reads its settings from `JAX_UB_*` environment variables once, when a setting is first "
        "needed (`jax_ub.config.get()`); an empty or blank variable counts as unset. In Python, "
        "`jax_ub.config.override(field=value)` changes them for a `with` block, checked like the "
        "variables. Every invalid value is named in one error; a `JAX_UB_*` variable that is no "
        "setting gets a warning naming the setting it most likely misspells."
    )
    out += ["## Settings", ""]
    out += _settings_text([s for s in group if not s.experimental])
    out += ["## Experimental settings", ""]
    out += _paragraph(
        "Knobs of the CUDA methods' schedules, for measuring them: how many pieces an op is cut into, "
        "how many SMs a bulk collective takes from its GEMM. They come with no compatibility promise: "
        "any release may change their meaning, range or default, or remove them. Their former names, "
        "without `EXPERIMENTAL_`, are still read, with a warning, until the next release."
    )
    out += _settings_text([s for s in group if s.experimental])
    out += ["## Deprecated and inert variables", ""]
    out += _paragraph(
        "Each of these, when set, gets a warning on the `jax_ub` logger. Where the new "
        "name is set as well, the former one is ignored."
    )
    out += ["| variable | now |", "|---|---|"]
    out += [f"| `{old}` | renamed `{new}` |" for old, new in DEPRECATED_VARIABLES.items()]
    out += [f"| `{var}` | {why} |" for var, why in INERT_VARIABLES.items()]
    out += ["", "## Other `JAX_UB_*` variables", ""]
    out += _paragraph("Not read by the package, and so never reported as unknown:")
    out += [f"* `{var}`: {what}." for var, what in OTHER_VARIABLES.items()]
    out += [f"* `{prefix}*`: the test launcher's, to its worker processes." for prefix in OTHER_PREFIXES]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_ub.config", description="jax_ub's settings.")
    p.add_argument(
        "--markdown",
        nargs="?",
        const="-",
        metavar="PATH",
        help=f"write the settings' documentation to PATH (stdout without one): `{REGENERATE}`",
    )
    a = p.parse_args(argv)
    if a.markdown is None:
        p.print_help()
    elif a.markdown == "-":
        sys.stdout.write(markdown())
    else:
        try:
            with open(a.markdown, "w", encoding="utf-8", newline="\n") as f:
                f.write(markdown())
        except OSError as e:  # argparse's `error:` and exit 2, as for a wrong option
            p.error(
                f"--markdown: expected a file path that can be written; got {a.markdown!r} ({e.strerror})"
            )
    return 0


if __name__ == "__main__":
    from jax_ub import config as _config  # the module jax_ub imported, not this copy run as __main__

    sys.exit(_config.main())
