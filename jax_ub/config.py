"""Every jax_ub knob in one place.

Each field of :class:`Config` has an environment variable (``JAX_UB_*``; empty or blank is unset)
that sets its default; :func:`get` returns the active configuration and :func:`override` changes it
for a ``with`` block (tests, benchmarks). Nothing else in the package reads ``os.environ``.

| field        | env var              | default | meaning |
|--------------|----------------------|---------|---------|
| method       | JAX_UB_METHOD        | auto    | ``auto``, ``xla`` or a CUDA algorithm (``ring``, ``all_peer``, ``push``, ``push_merge``, ``pipeline``, ``chain``, ``columns``, ``nccl``) |
| auto_chain   | JAX_UB_AUTO_CHAIN    | 0       | ``1``: ``auto`` may choose ``chain`` at tp >= 3 in bfloat16/float16, whose partial sums travel in the op's dtype (one rounding per hop; every other method sums in fp32); ``0``: where ``chain`` measured fastest there, ``auto`` runs the fastest of the others (:mod:`jax_ub.choice`) |
| disable      | JAX_UB_DISABLE       | 0       | ``1`` forces the pure-XLA reference path everywhere |
| timeout_s    | JAX_UB_TIMEOUT       | 120     | bound on every wait for a peer (seconds without progress, counted while this GPU is inside the op) |
| on_stall     | JAX_UB_ON_STALL      | abort   | after a timeout whose release cannot reach the GPU for 10 s (its command queue is stalled, so the XLA call can never return): ``abort`` the process after printing why, or ``wait`` (print, keep hanging) |
| bootstrap    | JAX_UB_BOOTSTRAP     | auto    | ``auto``, ``kv`` (jax.distributed key-value store) or ``nccl`` |
| transport    | JAX_UB_TRANSPORT     | auto    | ``auto``, ``ipc`` (copy engine over peer-mapped memory) or ``nccl`` |
| multicast    | JAX_UB_MULTICAST     | 0       | NVLink multicast (NVLS): ignored, no multicast path in this version (never on); ``UB_SKIPMC=1`` forces it off |
| buffer_mib   | JAX_UB_BUFFER_MIB    | 0       | registered buffer size per communicator at initialize (0: grow on demand) |
| gemm_workspace_mib | JAX_UB_GEMM_WORKSPACE_MIB | 32 | cuBLASLt workspace per GEMM call |
| gemm_tune    | JAX_UB_GEMM_TUNE     | 8       | cuBLASLt candidate algorithms timed per GEMM shape at trace time on random data; the fastest is kept where it beats the heuristic's first by > 3% (0 or 1: the heuristic's first, no timing) |
| recompute_gathered | JAX_UB_RECOMPUTE_GATHERED | 0 | ``1``: ``all_gather_matmul`` saves the local shard, not the gathered x, for its backward (re-gathered there under the dgrad GEMM) |
| bulk_reduce_sms | JAX_UB_BULK_REDUCE_SMS | 0 | SMs a bulk reduce-scatter keeps from its concurrent GEMM for the fp32 sum (0: the GEMM gets every SM and the sum runs after it, at full speed) |
| bulk_copy_sms | JAX_UB_BULK_COPY_SMS | 8 | SMs a bulk all-gather's GEMM leaves, over its first rows, to the gather's same-device copies (0: the GEMM gets every SM and waits for those copies) |
| rs_chain_pieces | JAX_UB_RS_CHAIN_PIECES | 0 | pieces per step of the ``chain`` GEMM->RS (1-4; 0: ``overlap.RS_CHAIN_PIECES``) |
| rs_chain_split | JAX_UB_RS_CHAIN_SPLIT | auto | how the ``chain`` cuts a step into pieces: ``rows``, ``cols`` (column blocks: w read once per step) or ``auto`` (``overlap.rs_chain_cols``) |
| rs_column_pieces | JAX_UB_RS_COLUMN_PIECES | 0 | column blocks of the ``columns`` GEMM->RS (1-8; 0: ``overlap.RS_COLUMN_PIECES``) |
| rs_pieces    | JAX_UB_RS_PIECES     | 0       | row pieces of a bare reduce-scatter (``overlap.reduce_scatter``), each summed as soon as every peer's piece has landed (1-8; 0: one per ``overlap.RS_PIECE_BYTES`` of a peer's rows, at most ``overlap.RS_PIECES``) |
| ag_push_pieces | JAX_UB_AG_PUSH_PIECES | 0 | row pieces of the last peer chunk of the ``push`` AG->GEMM (1-4; 0: ``overlap.ag_push_pieces``) |
| ag_push_merge | JAX_UB_AG_PUSH_MERGE | 0 | ``1``: the ``push`` AG->GEMM (without pieces, tp > 2) multiplies the peers' chunks as at most two GEMMs over their contiguous rows, each once its chunks have landed, instead of one GEMM per chunk; what method ``push_merge`` runs (which ``auto`` chooses where it measured fastest), for every call of ``push`` |
| tuning_file  | JAX_UB_TUNING_FILE   | (none)  | a ``python -m jax_ub.bench tune`` (or ``ag|rs``) JSON of this machine: where it measured a call's op, tp and dtype, ``method="auto"`` chooses from its records; elsewhere from the shipped ones (:mod:`jax_ub.choice`) |
| record_shapes | JAX_UB_RECORD_SHAPES | (none) | a path: every jax_ub op traced in this process adds its shape to this JSON file (rewritten at every traced op; ``<stem>.process<i>.json`` with several processes), for ``python -m jax_ub.bench tune`` (:mod:`jax_ub.tuning`) |
| log_level    | JAX_UB_LOG           | WARNING | level of the ``jax_ub`` logger (when set, printed on stderr unless logging is configured) |
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import math
import numbers
import os
import re
from collections.abc import Callable, Iterator, Mapping

METHODS = ("auto", "xla", "ring", "all_peer", "push", "push_merge", "pipeline", "chain", "columns", "nccl")
# JAX_UB_* variables that are not knobs of this table: the build's (CMakeLists.txt), CI's and the
# test launcher's (JAX_UB_TEST_*).
OTHER_VARIABLES = ("JAX_UB_CUDA_ARCHS", "JAX_UB_REQUIRE_CUDA", "JAX_UB_CI_VENV")
OTHER_PREFIXES = ("JAX_UB_TEST_",)
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


@dataclasses.dataclass(frozen=True)
class Config:
    method: str = "auto"
    auto_chain: bool = False
    disable: bool = False
    timeout_s: float = 120.0
    on_stall: str = "abort"
    bootstrap: str = "auto"
    transport: str = "auto"
    multicast: bool = False
    buffer_mib: int = 0
    gemm_workspace_mib: int = 32
    gemm_tune: int = 8
    recompute_gathered: bool = False
    bulk_reduce_sms: int = 0
    bulk_copy_sms: int = 8
    rs_chain_pieces: int = 0
    rs_chain_split: str = "auto"
    rs_column_pieces: int = 0
    rs_pieces: int = 0
    ag_push_pieces: int = 0
    ag_push_merge: bool = False
    tuning_file: str = ""
    record_shapes: str = ""
    log_level: str = "WARNING"

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
        for name, choices in (("method", METHODS), ("bootstrap", BOOTSTRAPS), ("transport", TRANSPORTS),
                              ("rs_chain_split", CHAIN_SPLITS), ("on_stall", ON_STALL)):
            object.__setattr__(self, name, _parse_choice(name, getattr(self, name), choices))
        level = self.log_level.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}; got {self.log_level!r}")
        object.__setattr__(self, "log_level", level)
        if not (math.isfinite(self.timeout_s) and self.timeout_s >= MIN_TIMEOUT_S):
            raise ValueError(f"timeout_s must be a finite number >= {MIN_TIMEOUT_S} (seconds); got "
                             f"{self.timeout_s!r}")
        if not 0 <= self.gemm_tune <= 16:
            raise ValueError(f"gemm_tune must be in [0, 16]; got {self.gemm_tune!r}")
        for name in ("bulk_reduce_sms", "bulk_copy_sms"):
            if not 0 <= getattr(self, name) <= 256:
                raise ValueError(f"{name} must be in [0, 256]; got {getattr(self, name)!r}")
        if not 0 <= self.rs_chain_pieces <= 4:
            raise ValueError(f"rs_chain_pieces must be in [0, 4]; got {self.rs_chain_pieces!r}")
        for name in ("rs_column_pieces", "rs_pieces"):
            if not 0 <= getattr(self, name) <= 8:
                raise ValueError(f"{name} must be in [0, 8]; got {getattr(self, name)!r}")
        if not 0 <= self.ag_push_pieces <= 4:
            raise ValueError(f"ag_push_pieces must be in [0, 4]; got {self.ag_push_pieces!r}")
        for name in ("buffer_mib", "gemm_workspace_mib"):
            if not 0 <= getattr(self, name) <= MAX_MIB:
                raise ValueError(f"{name} must be in [0, {MAX_MIB}] (MiB; {MAX_MIB} is 1 TiB); got "
                                 f"{getattr(self, name)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """The configuration the ``JAX_UB_*`` variables of ``environ`` (default ``os.environ``) set.
        Every invalid value is named in one ValueError (one sentence each); a ``JAX_UB_*`` name
        that is no setting gets a WARNING, with the setting it most likely misspells."""
        env = os.environ if environ is None else environ
        kw: dict[str, object] = {}
        errors: list[str] = []

        def take(var: str, field: str, parse: Callable[[str], object]) -> None:
            # Empty (or blank) is unset, for every variable (`JAX_UB_METHOD=${M:-}` in a script);
            # the boolean and path variables read it so already.
            if env.get(var, "").strip():
                try:
                    kw[field] = parse(env[var])
                except ValueError as e:
                    errors.append(str(e))

        for var, field, parse in (
            ("JAX_UB_METHOD", "method", lambda v: _parse_choice("JAX_UB_METHOD", v, METHODS)),
            ("JAX_UB_AUTO_CHAIN", "auto_chain", lambda v: _parse_bool("JAX_UB_AUTO_CHAIN", v)),
            ("JAX_UB_DISABLE", "disable", lambda v: _parse_bool("JAX_UB_DISABLE", v)),
            ("JAX_UB_TIMEOUT", "timeout_s",
             lambda v: float(_parse_number("JAX_UB_TIMEOUT", v, float, MIN_TIMEOUT_S))),
            ("JAX_UB_ON_STALL", "on_stall", lambda v: _parse_choice("JAX_UB_ON_STALL", v, ON_STALL)),
            ("JAX_UB_BOOTSTRAP", "bootstrap", lambda v: _parse_choice("JAX_UB_BOOTSTRAP", v, BOOTSTRAPS)),
            ("JAX_UB_TRANSPORT", "transport", lambda v: _parse_choice("JAX_UB_TRANSPORT", v, TRANSPORTS)),
            ("JAX_UB_BUFFER_MIB", "buffer_mib",
             lambda v: _bounded_int("JAX_UB_BUFFER_MIB", v, MAX_MIB, " (MiB: 1 TiB)")),
            ("JAX_UB_GEMM_WORKSPACE_MIB", "gemm_workspace_mib",
             lambda v: _bounded_int("JAX_UB_GEMM_WORKSPACE_MIB", v, MAX_MIB, " (MiB: 1 TiB)")),
            ("JAX_UB_GEMM_TUNE", "gemm_tune",
             lambda v: _bounded_int("JAX_UB_GEMM_TUNE", v, 16, " (cuBLASLt candidates)")),
            ("JAX_UB_RECOMPUTE_GATHERED", "recompute_gathered",
             lambda v: _parse_bool("JAX_UB_RECOMPUTE_GATHERED", v)),
            ("JAX_UB_BULK_REDUCE_SMS", "bulk_reduce_sms",
             lambda v: _bounded_int("JAX_UB_BULK_REDUCE_SMS", v, 256, " (SMs)")),
            ("JAX_UB_BULK_COPY_SMS", "bulk_copy_sms",
             lambda v: _bounded_int("JAX_UB_BULK_COPY_SMS", v, 256, " (SMs)")),
            ("JAX_UB_RS_CHAIN_PIECES", "rs_chain_pieces", lambda v: _bounded_int("JAX_UB_RS_CHAIN_PIECES", v, 4)),
            ("JAX_UB_RS_CHAIN_SPLIT", "rs_chain_split",
             lambda v: _parse_choice("JAX_UB_RS_CHAIN_SPLIT", v, CHAIN_SPLITS)),
            ("JAX_UB_RS_COLUMN_PIECES", "rs_column_pieces",
             lambda v: _bounded_int("JAX_UB_RS_COLUMN_PIECES", v, 8)),
            ("JAX_UB_RS_PIECES", "rs_pieces", lambda v: _bounded_int("JAX_UB_RS_PIECES", v, 8)),
            ("JAX_UB_AG_PUSH_PIECES", "ag_push_pieces", lambda v: _bounded_int("JAX_UB_AG_PUSH_PIECES", v, 4)),
            ("JAX_UB_AG_PUSH_MERGE", "ag_push_merge", lambda v: _parse_bool("JAX_UB_AG_PUSH_MERGE", v)),
            ("JAX_UB_LOG", "log_level", _parse_log_level),
        ):
            take(var, field, parse)
        multicast = False
        try:
            multicast = _parse_bool("JAX_UB_MULTICAST", env.get("JAX_UB_MULTICAST", "0"))
        except ValueError as e:
            errors.append(str(e))
        try:
            if _parse_bool("UB_SKIPMC", env.get("UB_SKIPMC", "0")):
                multicast = False  # TransformerEngine's switch, honoured as "off"
        except ValueError as e:
            errors.append(str(e))
        kw["multicast"] = multicast
        for var, field in (("JAX_UB_TUNING_FILE", "tuning_file"), ("JAX_UB_RECORD_SHAPES", "record_shapes")):
            if env.get(var, "").strip():
                kw[field] = env[var].strip()
        unknown = describe_unknown(env)
        if unknown:  # most likely a misspelt knob, which would otherwise change nothing silently
            logging.getLogger("jax_ub").warning("jax_ub: ignoring %s", "; ".join(unknown))
        if errors:
            raise ValueError(". ".join(errors))
        return cls(**kw)  # type: ignore[arg-type]


def _parse_log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"JAX_UB_LOG must be DEBUG, INFO, WARNING or ERROR; got {value!r}")
    return level


_active: Config | None = None
_LOG_FORMAT = "%(levelname)s %(message)s"  # most messages start with "jax_ub: " themselves


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """The ``JAX_UB_*`` names in ``env`` that are neither a knob nor one of ``OTHER_VARIABLES``."""
    return sorted(k for k in env if k.startswith("JAX_UB_") and k not in KNOB_VARIABLES
                  and k not in OTHER_VARIABLES and not k.startswith(OTHER_PREFIXES))


def describe_unknown(env: Mapping[str, str]) -> list[str]:
    """Each of :func:`unknown_variables`, said with the setting it most likely misspells:
    ``"JAX_UB_METHD: not a jax_ub setting (did you mean JAX_UB_METHOD?)"``, or without a close
    one, ``"...: not a jax_ub setting (the settings: JAX_UB_METHOD, ...)"``."""
    out = []
    for k in unknown_variables(env):
        near = closest_setting(k)
        out.append(f"{k}: not a jax_ub setting ("
                   + (f"did you mean {near}?)" if near else f"the settings: {', '.join(KNOB_VARIABLES)})"))
    return out


def closest_setting(name: str) -> str | None:
    """The jax_ub variable ``name`` most likely misspells, or None."""
    # Compared without the shared "JAX_UB_" (which alone made JAX_UB_FOO look like JAX_UB_LOG).
    prefix = "JAX_UB_"
    names = {v[len(prefix):]: v for v in KNOB_VARIABLES + OTHER_VARIABLES if v.startswith(prefix)}
    stem = name[len(prefix):] if name.startswith(prefix) else name
    near = difflib.get_close_matches(stem, list(names), n=1, cutoff=0.6)
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
        guesses = [(k, difflib.get_close_matches(k.lower().removeprefix("jax_ub_"), fields, n=1, cutoff=0.6))
                   for k in unknown]
        raise TypeError("config.override: " + "; ".join(
            f"{k!r} is not a jax_ub setting" + (f" (did you mean {g[0]!r}?)" if g else "")
            for k, g in guesses) + f". The settings: {', '.join(fields)}")
    _active = dataclasses.replace(previous, **changes)  # type: ignore[arg-type]
    if "log_level" in changes:
        logging.getLogger("jax_ub").setLevel(_active.log_level)
    try:
        yield _active
    finally:
        _active = previous
        if "log_level" in changes:
            logging.getLogger("jax_ub").setLevel(previous.log_level)


# The knobs' variables, in the order of the table above.
KNOB_VARIABLES = tuple(re.findall(r"^\| \w+ *\| (JAX_UB_\w+)", __doc__, re.MULTILINE))
