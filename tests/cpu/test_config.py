"""jax_ub.config: every JAX_UB_* variable, former and inert names, bad values, override(), the
generated docs/configuration.md."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_ub import config
from jax_ub.config import Config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_from_empty_environment():
    assert Config.from_env({}) == Config()
    assert dataclasses.asdict(Config()) == {
        "method": "auto", "auto_chain": False, "disable": False, "timeout_s": 120.0, "on_stall": "abort",
        "allow_reference": False, "bootstrap": "auto", "transport": "auto",
        "buffer_mib": 0, "gemm_workspace_mib": 32, "gemm_tune": 8,
        "recompute_gathered": False, "bulk_reduce_sms": 0, "bulk_copy_sms": 8, "rs_chain_pieces": 0,
        "rs_chain_split": "auto", "rs_column_pieces": 0, "rs_pieces": 0, "ag_push_pieces": 0,
        "ag_push_merge": False, "tuning_file": "", "record_shapes": "",
        "log_level": "WARNING",
    }  # fmt: skip


VARIABLES = [
    ("JAX_UB_METHOD", "ring", "method", "ring"),
    ("JAX_UB_METHOD", " XLA ", "method", "xla"),
    ("JAX_UB_METHOD", "all_peer", "method", "all_peer"),
    ("JAX_UB_EXPERIMENTAL_BULK_REDUCE_SMS", "16", "bulk_reduce_sms", 16),
    ("JAX_UB_EXPERIMENTAL_BULK_COPY_SMS", "0", "bulk_copy_sms", 0),
    ("JAX_UB_METHOD", "chain", "method", "chain"),
    ("JAX_UB_EXPERIMENTAL_RS_CHAIN_PIECES", "3", "rs_chain_pieces", 3),
    ("JAX_UB_EXPERIMENTAL_RS_CHAIN_SPLIT", " Cols ", "rs_chain_split", "cols"),
    ("JAX_UB_EXPERIMENTAL_AG_PUSH_PIECES", "2", "ag_push_pieces", 2),
    ("JAX_UB_EXPERIMENTAL_AG_PUSH_MERGE", "1", "ag_push_merge", True),
    ("JAX_UB_EXPERIMENTAL_RS_COLUMN_PIECES", "8", "rs_column_pieces", 8),
    ("JAX_UB_EXPERIMENTAL_RS_PIECES", " 4 ", "rs_pieces", 4),
    ("JAX_UB_METHOD", "columns", "method", "columns"),
    ("JAX_UB_TUNING_FILE", " /tmp/my-rs.json ", "tuning_file", "/tmp/my-rs.json"),
    ("JAX_UB_RECORD_SHAPES", " shapes.json ", "record_shapes", "shapes.json"),
    ("JAX_UB_DISABLE", "1", "disable", True),
    ("JAX_UB_DISABLE", "True", "disable", True),
    ("JAX_UB_ALLOW_REFERENCE", "1", "allow_reference", True),
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
    ("JAX_UB_BUFFER_MIB", "64", "buffer_mib", 64),
    ("JAX_UB_BUFFER_MIB", "0", "buffer_mib", 0),
    ("JAX_UB_GEMM_WORKSPACE_MIB", "8", "gemm_workspace_mib", 8),
    ("JAX_UB_GEMM_TUNE", "0", "gemm_tune", 0),
    ("JAX_UB_GEMM_TUNE", "4", "gemm_tune", 4),
    ("JAX_UB_LOG", "debug", "log_level", "DEBUG"),
    ("JAX_UB_LOG", "ERROR", "log_level", "ERROR"),
    ("JAX_UB_AUTO_CHAIN", "1", "auto_chain", True),
    ("JAX_UB_AUTO_CHAIN", "off", "auto_chain", False),
    ("JAX_UB_RECOMPUTE_GATHERED", "yes", "recompute_gathered", True),
]


@pytest.mark.parametrize("var,value,field,want", VARIABLES, ids=[f"{v[0]}={v[1]!r}" for v in VARIABLES])
def test_each_variable(var, value, field, want):
    c = Config.from_env({var: value})
    assert getattr(c, field) == want
    others = {f.name for f in dataclasses.fields(Config)} - {field}
    assert all(getattr(c, f) == getattr(Config(), f) for f in others)


def test_each_variable_is_its_own_field():
    """Every setting's variable, and only it, sets its field (VARIABLES covers them all)."""
    assert {v[0] for v in VARIABLES} == set(config.KNOB_VARIABLES)


EXPERIMENTAL = [
    "bulk_reduce_sms",
    "bulk_copy_sms",
    "rs_chain_pieces",
    "rs_chain_split",
    "rs_column_pieces",
    "rs_pieces",
    "ag_push_pieces",
    "ag_push_merge",
]


def test_the_schedule_experiments_are_the_experimental_settings():
    assert [s.field for s in config.settings() if s.experimental] == EXPERIMENTAL
    for s in config.settings():
        assert s.env.startswith("JAX_UB_EXPERIMENTAL_") is s.experimental, s
        assert bool(s.deprecated_env) is s.experimental, s  # each kept its former name for a release
        if s.experimental:
            assert s.deprecated_env == "JAX_UB_" + s.env.removeprefix("JAX_UB_EXPERIMENTAL_")
            assert config.DEPRECATED_VARIABLES[s.deprecated_env] == s.env


@pytest.mark.parametrize("field", EXPERIMENTAL)
def test_a_former_name_is_read_with_a_warning_naming_the_new_one(field, caplog):
    (s,) = [s for s in config.settings() if s.field == field]
    value = {"bool": "1", "int": "2", "str": "cols"}[Config.__dataclass_fields__[field].type]
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        c = Config.from_env({s.deprecated_env: value})
    assert c == Config.from_env({s.env: value}) != Config()
    (record,) = caplog.records
    assert record.getMessage() == (
        f"jax_ub: {s.deprecated_env} is deprecated and read until the next "
        f"release only: set {s.env} instead (experimental: no compatibility "
        "promise)"
    )


def test_the_new_name_wins_over_the_former_one(caplog):
    env = {"JAX_UB_RS_PIECES": "oops", "JAX_UB_EXPERIMENTAL_RS_PIECES": "3"}
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert Config.from_env(env).rs_pieces == 3  # the former one is not even parsed
    (record,) = caplog.records
    assert record.getMessage() == (
        "jax_ub: JAX_UB_RS_PIECES ignored: JAX_UB_EXPERIMENTAL_RS_PIECES, its new name, is set as well"
    )


def test_a_bad_value_under_a_former_name_is_named_by_that_name():
    with pytest.raises(ValueError, match=r"^JAX_UB_AG_PUSH_PIECES must be <= 4; got '9'$"):
        Config.from_env({"JAX_UB_AG_PUSH_PIECES": "9"})


@pytest.mark.parametrize(
    "var,value",
    [
        ("JAX_UB_MULTICAST", "1"),
        ("JAX_UB_MULTICAST", "2"),
        ("JAX_UB_MULTICAST", "0"),
        ("UB_SKIPMC", "1"),
        ("UB_SKIPMC", "?"),
    ],
)
def test_the_inert_variables_change_nothing_and_say_so(var, value, caplog):
    """No multicast path exists: JAX_UB_MULTICAST (and TransformerEngine's UB_SKIPMC, which turned it
    off) do nothing, whatever their value, and each says it goes."""
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        c = Config.from_env({var: value})
    assert c == Config() and c.multicast is False  # the attribute stays for its readers
    (record,) = caplog.records
    assert record.getMessage().startswith(f"jax_ub: {var} does nothing"), record.getMessage()
    assert "will be removed" in record.getMessage() or "will stop reading it" in record.getMessage()


def test_multicast_is_no_longer_a_field():
    assert "multicast" not in {f.name for f in dataclasses.fields(Config)}
    with (
        pytest.raises(TypeError, match="'multicast' is not a jax_ub setting"),
        config.override(multicast=True),
    ):
        pass


def test_former_and_inert_names_are_known():
    env = dict.fromkeys(
        [
            *config.DEPRECATED_VARIABLES,
            *config.DEPRECATED_VARIABLES.values(),
            *config.INERT_VARIABLES,
            *config.KNOB_VARIABLES,
        ],
        "",
    )
    assert config.unknown_variables(env) == []
    assert set(config.KNOWN_VARIABLES) == set(env)


def test_an_empty_value_is_the_variable_unset():
    """Every variable, empty or blank, gives the defaults: none is an error and none a value (they
    were: JAX_UB_METHOD= failed, JAX_UB_DISABLE= did not)."""
    names = [v[0] for v in VARIABLES] + [*config.DEPRECATED_VARIABLES, *config.INERT_VARIABLES]
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
    ("JAX_UB_BUFFER_MIB", "-1", "must be >= 0"),
    ("JAX_UB_BUFFER_MIB", "1.5", "must be an integer"),
    ("JAX_UB_GEMM_WORKSPACE_MIB", "lots", "must be an integer"),
    ("JAX_UB_GEMM_TUNE", "99", "must be <= 16"),
    ("JAX_UB_GEMM_TUNE", "-1", "must be >= 0"),
    ("JAX_UB_EXPERIMENTAL_BULK_REDUCE_SMS", "300", "must be <= 256"),
    ("JAX_UB_EXPERIMENTAL_BULK_REDUCE_SMS", "-4", "must be >= 0"),
    ("JAX_UB_EXPERIMENTAL_RS_CHAIN_PIECES", "5", "must be <= 4"),
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
    assert "did you mean JAX_UB_EXPERIMENTAL_AG_PUSH_MERGE?" in record.getMessage()


def test_a_misspelt_variable_gets_the_setting_it_most_likely_means(caplog):
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert Config.from_env({"JAX_UB_METHD": "xla", "JAX_UB_TIMOUT": "5"}) == Config()
    (record,) = caplog.records
    msg = record.getMessage()
    assert "JAX_UB_METHD: not a jax_ub setting (did you mean JAX_UB_METHOD?)" in msg, msg
    assert "JAX_UB_TIMOUT: not a jax_ub setting (did you mean JAX_UB_TIMEOUT?)" in msg, msg
    assert config.describe_unknown({"JAX_UB_METHD": "xla", "PATH": "/bin"}) == [
        "JAX_UB_METHD: not a jax_ub setting (did you mean JAX_UB_METHOD?)"
    ]


@pytest.mark.parametrize(
    "name, near",
    [
        ("JAX_UB_FOO", None),
        ("JAX_UB_X", None),
        ("JAX_UB_DEBUG", None),  # the shared prefix is no likeness
        ("JAX_UB_LGO", "JAX_UB_LOG"),
        ("JAX_UB_DISABLED", "JAX_UB_DISABLE"),
        ("JAX_UB_TUNNING_FILE", "JAX_UB_TUNING_FILE"),
        ("JAX_UB_TRANSPROT", "JAX_UB_TRANSPORT"),
        ("JAX_UB_RS_PEICES", "JAX_UB_EXPERIMENTAL_RS_PIECES"),  # a misspelt former name: the new one
        ("JAX_UB_EXPERIMENTAL_RS_PEICES", "JAX_UB_EXPERIMENTAL_RS_PIECES"),
        ("JAX_UB_EXPERIMENTAL_METHD", "JAX_UB_METHOD"),
        ("JAX_UB_EXPERIMENTAL_FOO", None),
    ],
)
def test_the_likely_setting_is_judged_on_the_name_after_the_prefix(name, near):
    """JAX_UB_FOO once got "did you mean JAX_UB_LOG?": the common JAX_UB_ made any short name look
    close; "EXPERIMENTAL_" is left out likewise. Without a close setting the message lists the settings
    instead."""
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
    env = {
        "JAX_UB_METHOD": "rign",
        "JAX_UB_GEMM_TUNE": "99",
        "JAX_UB_LOG": "verbose",
        "JAX_UB_RS_PIECES": "?",
        "JAX_UB_METHD": "x",
    }
    with caplog.at_level(logging.WARNING, logger="jax_ub"), pytest.raises(ValueError) as info:
        Config.from_env(env)
    msg = str(info.value)
    for fragment in (
        "JAX_UB_METHOD must be one of",
        "got 'rign'",
        "JAX_UB_GEMM_TUNE must be <= 16",
        "got '99'",
        "JAX_UB_LOG must be DEBUG",
        "got 'verbose'",
        "JAX_UB_RS_PIECES must be an integer",
        "got '?'",
    ):
        assert fragment in msg, msg
    assert "did you mean JAX_UB_METHOD?" in caplog.text  # the warning is not lost to the error


def test_every_field_has_one_documented_variable():
    """Each field's metadata names its variable, its values and its meaning; no two share a name."""
    fields = [f.name for f in dataclasses.fields(Config)]
    assert len(config.KNOB_VARIABLES) == len(fields) == len(set(config.KNOB_VARIABLES))
    names = [
        *config.KNOB_VARIABLES,
        *config.DEPRECATED_VARIABLES,
        *config.INERT_VARIABLES,
        *config.OTHER_VARIABLES,
    ]
    assert len(names) == len(set(names)), names
    for s in config.settings():
        assert s.env.startswith("JAX_UB_") and s.values and len(s.doc) > 40, s
        assert s.default == getattr(Config(), s.field), s


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
    with (
        pytest.raises(
            TypeError,
            match=r"^config.override: 'methd' is not a jax_ub setting \(did you "
            r"mean 'method'\?\)",
        ),
        config.override(methd="xla"),
    ):
        pass
    with (
        pytest.raises(
            TypeError,
            match=r"'JAX_UB_TIMEOUT' is not a jax_ub setting \(did you mean "
            r"'timeout_s'\?\)",
        ),
        config.override(JAX_UB_TIMEOUT=5),
    ):
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
    [
        ("disable", "0", "a bool"),
        ("ag_push_merge", 1, "a bool"),
        ("recompute_gathered", "yes", "a bool"),
        ("timeout_s", "30", "a number"),
        ("timeout_s", True, "a number"),
        ("buffer_mib", 1.5, "an int"),
        ("gemm_tune", True, "an int"),
        ("rs_chain_pieces", "2", "an int"),
        ("method", None, "a str"),
        ("tuning_file", None, "a str"),
        ("log_level", 10, "a str"),
    ],
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


@pytest.mark.parametrize(
    "value", [float("inf"), float("nan"), -1.0, 1e-4], ids=["inf", "nan", "negative", "below_env_minimum"]
)
def test_timeout_must_be_finite_and_at_least_a_millisecond(value):
    """The same minimum as JAX_UB_TIMEOUT's (config.MIN_TIMEOUT_S)."""
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number >= 0.001 \(seconds\); got"):
        Config(timeout_s=value)
    with pytest.raises(ValueError, match=r"JAX_UB_TIMEOUT must be (>= 0.001|a finite number); got"):
        Config.from_env({"JAX_UB_TIMEOUT": repr(value)})
    assert Config(timeout_s=config.MIN_TIMEOUT_S).timeout_s == 1e-3


def test_bad_log_level_rejected():
    with pytest.raises(
        ValueError, match=r"log_level must be one of \('DEBUG', 'INFO', 'WARNING', 'ERROR'\); got 'loud'"
    ):
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
    p = subprocess.run(
        [sys.executable, "-c", _RESOLVE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert p.stdout.strip() == "xla"
    assert ("DEBUG jax_ub: method 'auto' -> 'xla'" in p.stderr) is shown, p.stderr


def test_the_configuration_docs_are_the_generated_ones():
    """docs/configuration.md is generated from the fields' metadata: a changed setting (a default,
    a range, a meaning) changes it, by regenerating it."""
    path = REPO / config.DOCS_PATH
    assert path.is_file() and path.read_text(encoding="utf-8") == config.markdown(), (
        f"{config.DOCS_PATH} is not what jax_ub/config.py generates: run `{config.REGENERATE}`"
    )
    text = config.markdown()
    for s in config.settings():
        assert f"### `{s.env}`" in text and s.doc in " ".join(text.split()), s.env
    for name in (*config.DEPRECATED_VARIABLES, *config.INERT_VARIABLES, *config.OTHER_VARIABLES):
        assert f"`{name}`" in text, name
    experimental = text.index("## Experimental settings")
    assert all((text.index(f"### `{s.env}`") > experimental) is s.experimental for s in config.settings())


def test_the_docs_command_writes_the_docs(tmp_path):
    """The regenerating command runs as printed, and without a warning (runpy's, about a module the
    package imported first, is silenced)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_UB_")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = tmp_path / "configuration.md"
    p = subprocess.run(
        [sys.executable, "-m", "jax_ub.config", "--markdown", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    assert p.stderr == "" and p.stdout == ""
    assert out.read_text(encoding="utf-8") == config.markdown()
    p = subprocess.run(
        [sys.executable, "-m", "jax_ub.config", "--markdown"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    assert p.stdout == config.markdown() and p.stderr == ""


@pytest.mark.parametrize("name", ["JAX_UB_BUFFER_MIB", "JAX_UB_GEMM_WORKSPACE_MIB"])
def test_sizes_above_a_tebibyte_are_refused_by_name(name):
    """Not left to overflow a size in the extension: 1 TiB is more than any GPU has."""
    assert getattr(Config.from_env({name: str(1 << 20)}), name[len("JAX_UB_") :].lower()) == 1 << 20
    with pytest.raises(
        ValueError, match=f"{name} must be <= 1048576 \\(MiB: 1 TiB\\); got '99999999999999999999'"
    ):
        Config.from_env({name: "99999999999999999999"})
    with pytest.raises(ValueError, match=r"must be in \[0, 1048576\]"):
        Config(**{name[len("JAX_UB_") :].lower(): (1 << 20) + 1})
