"""jax_ub.config: every JAX_UB_* variable, UB_SKIPMC, bad values, override()."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from jax_ub import config
from jax_ub.config import Config


def test_defaults_from_empty_environment():
    assert Config.from_env({}) == Config()
    assert dataclasses.asdict(Config()) == {
        "method": "auto", "auto_chain": False, "disable": False, "timeout_s": 120.0, "on_stall": "abort", "bootstrap": "auto", "transport": "auto",
        "multicast": False, "buffer_mib": 0, "gemm_workspace_mib": 32, "gemm_tune": 8,
        "recompute_gathered": False, "bulk_reduce_sms": 0, "bulk_copy_sms": 8, "rs_chain_pieces": 0,
        "rs_chain_split": "auto", "rs_column_pieces": 0, "rs_pieces": 0, "ag_push_pieces": 0, "ag_push_merge": False, "tuning_file": "", "record_shapes": "",
        "log_level": "WARNING",
    }  # fmt: skip


VARIABLES = [
    ("JAX_UB_METHOD", "ring", "method", "ring"),
    ("JAX_UB_METHOD", " XLA ", "method", "xla"),
    ("JAX_UB_METHOD", "all_peer", "method", "all_peer"),
    ("JAX_UB_BULK_REDUCE_SMS", "16", "bulk_reduce_sms", 16),
    ("JAX_UB_BULK_COPY_SMS", "0", "bulk_copy_sms", 0),
    ("JAX_UB_METHOD", "chain", "method", "chain"),
    ("JAX_UB_RS_CHAIN_PIECES", "3", "rs_chain_pieces", 3),
    ("JAX_UB_RS_CHAIN_SPLIT", " Cols ", "rs_chain_split", "cols"),
    ("JAX_UB_AG_PUSH_PIECES", "2", "ag_push_pieces", 2),
    ("JAX_UB_AG_PUSH_MERGE", "1", "ag_push_merge", True),
    ("JAX_UB_RS_COLUMN_PIECES", "8", "rs_column_pieces", 8),
    ("JAX_UB_RS_PIECES", " 4 ", "rs_pieces", 4),
    ("JAX_UB_METHOD", "columns", "method", "columns"),
    ("JAX_UB_TUNING_FILE", " /tmp/my-rs.json ", "tuning_file", "/tmp/my-rs.json"),
    ("JAX_UB_RECORD_SHAPES", " shapes.json ", "record_shapes", "shapes.json"),
    ("JAX_UB_DISABLE", "1", "disable", True),
    ("JAX_UB_DISABLE", "True", "disable", True),
    ("JAX_UB_DISABLE", "off", "disable", False),
    ("JAX_UB_DISABLE", "", "disable", False),
    ("JAX_UB_TIMEOUT", "5.5", "timeout_s", 5.5),
    ("JAX_UB_TIMEOUT", "30", "timeout_s", 30.0),
    ("JAX_UB_ON_STALL", " Wait ", "on_stall", "wait"),
    ("JAX_UB_ON_STALL", "abort", "on_stall", "abort"),
    ("JAX_UB_BOOTSTRAP", "nccl", "bootstrap", "nccl"),
    ("JAX_UB_BOOTSTRAP", "kv", "bootstrap", "kv"),
    ("JAX_UB_TRANSPORT", "ipc", "transport", "ipc"),
    ("JAX_UB_TRANSPORT", "NCCL", "transport", "nccl"),
    ("JAX_UB_MULTICAST", "1", "multicast", True),
    ("JAX_UB_MULTICAST", "no", "multicast", False),
    ("JAX_UB_BUFFER_MIB", "64", "buffer_mib", 64),
    ("JAX_UB_BUFFER_MIB", "0", "buffer_mib", 0),
    ("JAX_UB_GEMM_WORKSPACE_MIB", "8", "gemm_workspace_mib", 8),
    ("JAX_UB_GEMM_TUNE", "0", "gemm_tune", 0),
    ("JAX_UB_GEMM_TUNE", "4", "gemm_tune", 4),
    ("JAX_UB_LOG", "debug", "log_level", "DEBUG"),
    ("JAX_UB_LOG", "ERROR", "log_level", "ERROR"),
    ("JAX_UB_AUTO_CHAIN", "1", "auto_chain", True),
    ("JAX_UB_AUTO_CHAIN", "off", "auto_chain", False),
]


@pytest.mark.parametrize("var,value,field,want", VARIABLES, ids=[f"{v[0]}={v[1]!r}" for v in VARIABLES])
def test_each_variable(var, value, field, want):
    c = Config.from_env({var: value})
    assert getattr(c, field) == want
    others = {f.name for f in dataclasses.fields(Config)} - {field}
    assert all(getattr(c, f) == getattr(Config(), f) for f in others)


@pytest.mark.parametrize(
    "env,want",
    [
        ({"JAX_UB_MULTICAST": "1", "UB_SKIPMC": "1"}, False),
        ({"JAX_UB_MULTICAST": "1", "UB_SKIPMC": "0"}, True),
        ({"JAX_UB_MULTICAST": "1", "UB_SKIPMC": "true"}, False),
        ({"UB_SKIPMC": "1"}, False),
        ({"JAX_UB_MULTICAST": "1"}, True),
    ],
    ids=["skipmc-wins", "skipmc-0", "skipmc-true", "skipmc-only", "multicast-only"],
)
def test_ub_skipmc_turns_multicast_off(env, want):
    assert Config.from_env(env).multicast is want


def test_an_empty_value_is_the_variable_unset():
    """Every variable, empty or blank, gives the defaults: none is an error and none a value (they
    were: JAX_UB_METHOD= failed, JAX_UB_DISABLE= did not)."""
    names = [v[0] for v in VARIABLES] + ["UB_SKIPMC"]
    for blank in ("", "  "):
        assert Config.from_env({n: blank for n in names}) == Config()
        for n in names:
            assert Config.from_env({n: blank}) == Config(), n


BAD_VALUES = [
    ("JAX_UB_METHOD", "fast", "one of ('auto', 'xla', 'ring'"),
    ("JAX_UB_DISABLE", "maybe", "one of ('1', 'true'"),
    ("JAX_UB_TIMEOUT", "soon", "must be a number"),
    ("JAX_UB_TIMEOUT", "0", "must be >= 0.001"),
    ("JAX_UB_TIMEOUT", "-3", "must be >= 0.001"),
    ("JAX_UB_TIMEOUT", "inf", "must be a finite number"),
    ("JAX_UB_TIMEOUT", "nan", "must be a finite number"),
    ("JAX_UB_ON_STALL", "retry", "one of ('abort', 'wait')"),
    ("JAX_UB_BOOTSTRAP", "mpi", "one of ('auto', 'kv', 'nccl')"),
    ("JAX_UB_TRANSPORT", "shm", "one of ('auto', 'ipc', 'nccl')"),
    ("JAX_UB_MULTICAST", "2", "one of ('1', 'true'"),
    ("UB_SKIPMC", "sometimes", "one of ('1', 'true'"),
    ("JAX_UB_BUFFER_MIB", "-1", "must be >= 0"),
    ("JAX_UB_BUFFER_MIB", "1.5", "must be an integer"),
    ("JAX_UB_GEMM_WORKSPACE_MIB", "lots", "must be an integer"),
    ("JAX_UB_GEMM_TUNE", "99", "must be <= 16"),
    ("JAX_UB_GEMM_TUNE", "-1", "must be >= 0"),
    ("JAX_UB_BULK_REDUCE_SMS", "300", "must be <= 256"),
    ("JAX_UB_BULK_REDUCE_SMS", "-4", "must be >= 0"),
    ("JAX_UB_RS_CHAIN_PIECES", "5", "must be <= 4"),
    ("JAX_UB_LOG", "verbose", "DEBUG, INFO, WARNING or ERROR"),
    ("JAX_UB_AUTO_CHAIN", "sometimes", "one of ('1', 'true'"),
]


@pytest.mark.parametrize("var,value,expected", BAD_VALUES, ids=[f"{v[0]}={v[1]!r}" for v in BAD_VALUES])
def test_bad_values_name_variable_and_value(var, value, expected):
    with pytest.raises(ValueError) as info:
        Config.from_env({var: value})
    msg = str(info.value)
    assert var in msg and repr(value) in msg and expected in msg, msg


@pytest.mark.parametrize(
    "kw",
    [
        {"method": "fast"},
        {"bootstrap": "mpi"},
        {"transport": "shm"},
        {"timeout_s": 0.0},
        {"buffer_mib": -1},
        {"gemm_workspace_mib": -2},
        {"bulk_reduce_sms": 999},
        {"bulk_copy_sms": -1},
        {"rs_chain_pieces": 8},
        {"rs_chain_split": "diagonal"},
        {"ag_push_pieces": 5},
        {"rs_column_pieces": 9},
        {"rs_pieces": -1},
        {"on_stall": "ignore"},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_invalid_fields_rejected_on_construction(kw):
    with pytest.raises(ValueError) as info:
        Config(**kw)
    assert repr(next(iter(kw.values()))) in str(info.value)


def test_unrelated_variables_ignored(caplog):
    env = {"XLA_FLAGS": "--foo", "PATH": "/bin", "JAX_UB_CUDA_ARCHS": "90a", "JAX_UB_TEST_RANK": "0"}
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert Config.from_env(env) == Config()
    assert not caplog.records


def test_misspelt_variable_is_named_in_a_warning(caplog):
    """A misspelt knob would otherwise change nothing, silently."""
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert Config.from_env({"JAX_UB_AG_MERGE": "on", "JAX_UB_METHOD": "xla"}) == Config(method="xla")
    (record,) = caplog.records
    assert "ignoring JAX_UB_AG_MERGE: not a jax_ub setting" in record.getMessage()
    assert "JAX_UB_AG_PUSH_MERGE" in record.getMessage()


def test_a_misspelt_variable_gets_the_setting_it_most_likely_means(caplog):
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert Config.from_env({"JAX_UB_METHD": "xla", "JAX_UB_TIMOUT": "5"}) == Config()
    (record,) = caplog.records
    msg = record.getMessage()
    assert "JAX_UB_METHD: not a jax_ub setting (did you mean JAX_UB_METHOD?)" in msg, msg
    assert "JAX_UB_TIMOUT: not a jax_ub setting (did you mean JAX_UB_TIMEOUT?)" in msg, msg
    assert config.describe_unknown({"JAX_UB_METHD": "xla", "PATH": "/bin"}) == [
        "JAX_UB_METHD: not a jax_ub setting (did you mean JAX_UB_METHOD?)"]


@pytest.mark.parametrize("name, near", [
    ("JAX_UB_FOO", None), ("JAX_UB_X", None), ("JAX_UB_DEBUG", None),  # the shared prefix is no likeness
    ("JAX_UB_LGO", "JAX_UB_LOG"), ("JAX_UB_DISABLED", "JAX_UB_DISABLE"),
    ("JAX_UB_TUNNING_FILE", "JAX_UB_TUNING_FILE"), ("JAX_UB_TRANSPROT", "JAX_UB_TRANSPORT"),
])
def test_the_likely_setting_is_judged_on_the_name_after_the_prefix(name, near):
    """JAX_UB_FOO once got "did you mean JAX_UB_LOG?": the common JAX_UB_ made any short name look
    close. Without a close setting the message lists the settings instead."""
    assert config.closest_setting(name) == near
    (line,) = config.describe_unknown({name: "1"})
    assert line.startswith(f"{name}: not a jax_ub setting (")
    assert (f"did you mean {near}?" in line) if near else ("the settings: JAX_UB_METHOD, " in line), line


def test_jax_ub_exp_is_not_a_setting(caplog):
    """Nothing in jax_ub reads it (a temporary C++ change of a probe once did): setting it changes
    nothing, so it is named like any other unknown variable."""
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        Config.from_env({"JAX_UB_EXP": "2"})
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == ["ignoring JAX_UB_EXP"]


def test_every_invalid_value_is_named_at_once(caplog):
    env = {"JAX_UB_METHOD": "rign", "JAX_UB_GEMM_TUNE": "99", "JAX_UB_LOG": "verbose", "UB_SKIPMC": "?",
           "JAX_UB_METHD": "x"}
    with caplog.at_level(logging.WARNING, logger="jax_ub"), pytest.raises(ValueError) as info:
        Config.from_env(env)
    msg = str(info.value)
    for fragment in ("JAX_UB_METHOD must be one of", "got 'rign'", "JAX_UB_GEMM_TUNE must be <= 16",
                     "got '99'", "JAX_UB_LOG must be DEBUG", "got 'verbose'", "UB_SKIPMC must be one of",
                     "got '?'"):
        assert fragment in msg, msg
    assert "did you mean JAX_UB_METHOD?" in caplog.text  # the warning is not lost to the error


def test_every_field_has_one_documented_variable():
    """The table in config's docstring lists every field once; README's table lists the same
    variables."""
    fields = [f.name for f in dataclasses.fields(Config)]
    assert len(config.KNOB_VARIABLES) == len(fields) == len(set(config.KNOB_VARIABLES))


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().method = "xla"  # type: ignore[misc]


def test_get_reads_environment_once(monkeypatch):
    monkeypatch.setattr(config, "_active", None)
    monkeypatch.setenv("JAX_UB_METHOD", "xla")
    monkeypatch.setenv("JAX_UB_TIMEOUT", "7")
    first = config.get()
    assert (first.method, first.timeout_s) == ("xla", 7.0)
    monkeypatch.setenv("JAX_UB_METHOD", "ring")
    assert config.get() is first  # cached until override/reset


def test_override_restores_on_exit():
    before = config.get()
    with config.override(method="xla", timeout_s=3.0) as c:
        assert config.get() is c and (c.method, c.timeout_s) == ("xla", 3.0)
        assert c.bootstrap == before.bootstrap
    assert config.get() is before


def test_override_restores_after_exception():
    before = config.get()
    with pytest.raises(RuntimeError), config.override(disable=True):
        assert config.get().disable
        raise RuntimeError("boom")
    assert config.get() is before


def test_override_nests():
    before = config.get()
    with config.override(method="xla"):
        with config.override(disable=True):
            assert (config.get().method, config.get().disable) == ("xla", True)
        assert (config.get().method, config.get().disable) == ("xla", before.disable)
    assert config.get() is before


def test_override_with_invalid_value_leaves_config_unchanged():
    before = config.get()
    with pytest.raises(ValueError, match="'fast'"), config.override(method="fast"):
        pass
    assert config.get() is before


def test_override_unknown_field():
    before = config.get()
    with pytest.raises(TypeError, match="no_such_knob") as info, config.override(no_such_knob=1):
        pass
    assert "'no_such_knob' is not a jax_ub setting. The settings: " in str(info.value)
    assert config.get() is before
    with pytest.raises(TypeError, match=r"^config.override: 'methd' is not a jax_ub setting \(did you "
                                        r"mean 'method'\?\)"), config.override(methd="xla"):
        pass
    with pytest.raises(TypeError, match=r"'JAX_UB_TIMEOUT' is not a jax_ub setting \(did you mean "
                                        r"'timeout_s'\?\)"), config.override(JAX_UB_TIMEOUT=5):
        pass
    assert config.get() is before


# ------------------------------------------------------------------------------------------------
# Fields set directly (Config(...), override(...)): the normal form and types of from_env's values.


def test_choices_are_normalised():
    c = Config(method=" XLA ", bootstrap="KV", transport="Nccl", log_level="debug")
    assert (c.method, c.bootstrap, c.transport, c.log_level) == ("xla", "kv", "nccl", "DEBUG")
    with config.override(method="XLA") as c:
        assert c.method == "xla"


def test_numbers_are_normalised():
    c = Config(timeout_s=30, buffer_mib=np.int64(64))
    assert c.timeout_s == 30.0 and type(c.timeout_s) is float
    assert c.buffer_mib == 64 and type(c.buffer_mib) is int


@pytest.mark.parametrize(
    "field,value,kind",
    [("disable", "0", "a bool"), ("multicast", 1, "a bool"), ("recompute_gathered", "yes", "a bool"),
     ("timeout_s", "30", "a number"), ("timeout_s", True, "a number"), ("buffer_mib", 1.5, "an int"),
     ("gemm_tune", True, "an int"), ("rs_chain_pieces", "2", "an int"), ("method", None, "a str"),
     ("tuning_file", None, "a str"), ("log_level", 10, "a str")],
    ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None,
)
def test_wrong_types_rejected_naming_the_field(field, value, kind):
    with pytest.raises(TypeError) as info:
        Config(**{field: value})
    assert str(info.value) == f"{field} must be {kind}; got {value!r}"
    before = config.get()
    with pytest.raises(TypeError, match=field), config.override(**{field: value}):
        pass
    assert config.get() is before


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 1e-4],
                         ids=["inf", "nan", "negative", "below_env_minimum"])
def test_timeout_must_be_finite_and_at_least_a_millisecond(value):
    """The same minimum as JAX_UB_TIMEOUT's (config.MIN_TIMEOUT_S)."""
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number >= 0.001 \(seconds\); got"):
        Config(timeout_s=value)
    with pytest.raises(ValueError, match=r"JAX_UB_TIMEOUT must be (>= 0.001|a finite number); got"):
        Config.from_env({"JAX_UB_TIMEOUT": repr(value)})
    assert Config(timeout_s=config.MIN_TIMEOUT_S).timeout_s == 1e-3


def test_bad_log_level_rejected():
    with pytest.raises(ValueError, match=r"log_level must be one of \('DEBUG', 'INFO', 'WARNING', 'ERROR'\); got 'loud'"):
        Config(log_level="loud")


# ------------------------------------------------------------------------------------------------
# JAX_UB_LOG: the level, and a handler that prints it.


def test_override_applies_the_log_level():
    log = logging.getLogger("jax_ub")
    before = log.level
    with config.override(log_level="debug"):
        assert log.level == logging.DEBUG
    assert log.level == before


_RESOLVE = "import jax_ub; from jax_ub import ops; print(ops._resolve_method('auto'))"


@pytest.mark.parametrize("level,shown", [("DEBUG", True), ("INFO", False), (None, False)])
def test_jax_ub_log_prints_on_stderr(level, shown):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_UB_")}
    env["JAX_PLATFORMS"] = "cpu"
    if level:
        env["JAX_UB_LOG"] = level
    p = subprocess.run([sys.executable, "-c", _RESOLVE], env=env, capture_output=True, text=True,
                       timeout=120, check=True)
    assert p.stdout.strip() == "xla"
    assert ("DEBUG jax_ub: method 'auto' -> 'xla'" in p.stderr) is shown, p.stderr


def test_readme_env_table_gives_the_configs_defaults():
    """Every ``JAX_UB_*`` row of README's table names the default that ``Config`` has (a changed
    default, like GEMM tuning's, must change the documentation with it)."""
    import dataclasses
    import re
    from pathlib import Path

    from jax_ub import config

    doc_rows = {}  # env var -> field, from the module's own table
    for line in config.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("JAX_UB_"):
            doc_rows[cells[1]] = cells[0]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| `(JAX_UB_[A-Z_]+)` \|\s*`?([^|`]*?)`?\s*\|", readme, re.M)
    assert len(rows) >= 20, rows
    defaults = {f.name: f.default for f in dataclasses.fields(config.Config)}
    checked = 0
    for env, shown in rows:
        field = doc_rows.get(env)
        if field is None or field not in defaults:
            continue
        want = defaults[field]
        if isinstance(want, bool):
            want = "1" if want else "0"
        elif isinstance(want, float) and want.is_integer():
            want = int(want)
        elif want is None:
            want = ""
        assert shown.strip() == str(want), f"README says {env} defaults to {shown!r}; Config.{field} is {want!r}"
        checked += 1
    # Every knob has a README row and every README row is a knob (or a build-time variable).
    readme_vars = {env for env, _ in rows} - set(config.OTHER_VARIABLES)
    assert readme_vars == set(config.KNOB_VARIABLES), readme_vars ^ set(config.KNOB_VARIABLES)
    assert set(doc_rows.values()) == set(defaults), set(doc_rows.values()) ^ set(defaults)
    assert checked == len(config.KNOB_VARIABLES), checked


@pytest.mark.parametrize("name", ["JAX_UB_BUFFER_MIB", "JAX_UB_GEMM_WORKSPACE_MIB"])
def test_sizes_above_a_tebibyte_are_refused_by_name(name):
    """Not left to overflow a size in the extension: 1 TiB is more than any GPU has."""
    assert getattr(Config.from_env({name: str(1 << 20)}), name[len("JAX_UB_"):].lower()) == 1 << 20
    with pytest.raises(ValueError, match=f"{name} must be <= 1048576 \\(MiB: 1 TiB\\); got '99999999999999999999'"):
        Config.from_env({name: "99999999999999999999"})
    with pytest.raises(ValueError, match=r"must be in \[0, 1048576\]"):
        Config(**{name[len("JAX_UB_"):].lower(): (1 << 20) + 1})
