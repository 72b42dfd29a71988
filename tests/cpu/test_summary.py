"""``jax_ub.summary()``: traced ops per path and method, host µs per op from the communicators'
stats, failures; the one line ``jax_ub.shutdown()`` logs."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import _usage, usage

TP = 4


@pytest.fixture(autouse=True)
def _fresh_usage():
    _usage.reset()
    yield
    _usage.reset()


def _layer(mesh):
    """AG then RS (a TP MLP), reference path on the host devices."""

    def body(x, w1, w2):
        h = jax_ub.all_gather_matmul(x, w1, "tp")
        return jax_ub.matmul_reduce_scatter(jnp.tanh(h), w2, "tp")

    return jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))


def test_counts_traced_ops_per_path_and_method(cpu_mesh):
    mesh = cpu_mesh(TP)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (TP * 4, 8))
    w1 = jax.random.normal(k[1], (8, TP * 3))
    w2 = jax.random.normal(k[2], (TP * 3, 5))
    f = jax.jit(_layer(mesh))
    y = f(x, w1, w2)
    f(x + 1, w1, w2)  # cached: no new trace, no new count
    want = np.tanh(np.asarray(x, np.float64) @ np.asarray(w1, np.float64)) @ np.asarray(w2, np.float64)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    s = jax_ub.summary()
    # The host has no CUDA path: "auto" resolves to the reference before it is traced.
    assert s.ops == {("ag", "reference", "xla"): 1, ("rs", "reference", "xla"): 1}
    assert s.per_path() == {"cuda": 0, "reference": 2}
    assert s.host == {} and s.host_us_per_op() is None and s.failure_count == 0
    jax.grad(lambda x: _layer(mesh)(x, w1, w2).sum())(x)  # the backward's ops are the reference's
    assert jax_ub.summary().per_path()["reference"] == 4
    text = str(jax_ub.summary())
    assert (
        text.splitlines()[0]
        == "jax_ub: traced ops: 0 cuda, 4 reference (xla=4); no CUDA op ran; 0 failure(s)"
    )
    assert "  ag       reference xla                2" in text


def test_bulk_ops_counted(cpu_mesh):
    mesh = cpu_mesh(TP)
    k = jax.random.split(jax.random.key(1), 3)
    x, a, b = (
        jax.random.normal(k[0], (TP * 2, 3)),
        jax.random.normal(k[1], (5, 6)),
        jax.random.normal(k[2], (6, 7)),
    )
    f = jax.shard_map(
        lambda x, a, b: jax_ub.bulk_all_gather(x, a, b, "tp"),
        mesh=mesh,
        in_specs=(P("tp"), P(), P()),
        out_specs=(P(), P()),
        check_vma=False,
    )
    g, ab = f(x, a, b)
    np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=0, atol=0)
    np.testing.assert_allclose(
        np.asarray(ab), np.asarray(a, np.float64) @ np.asarray(b, np.float64), rtol=1e-5
    )
    assert jax_ub.summary().ops == {("bulk_ag", "reference", "xla"): 1}


def test_auto_choices_and_host_stats_formatting():
    """The recorder's arithmetic on recorded CUDA-path facts (no GPU here to produce them)."""
    _usage.record("ag", "auto")
    _usage.record_auto("ag", "ring")
    _usage.record_auto("rs", "pipeline")
    _usage.record("rs", "ring")
    _usage.note_freed({("tp", 0): {"ops": 10, "host_s": 50e-6, "meet_s": 0.0}})
    s = _usage.snapshot(
        live_host={("tp", 1): {"ops": 30, "host_s": 90e-6, "meet_s": 1e-6}},
        live_errors={("tp", 1): "peer 3 timed out"},
    )
    assert s.per_path() == {"cuda": 3, "reference": 0}
    assert s.host[("tp", 0)]["host_us_per_op"] == pytest.approx(5.0)
    assert s.host[("tp", 1)]["host_us_per_op"] == pytest.approx(3.0)
    assert s.host_us_per_op() == pytest.approx(140 / 40)
    assert s.failure_count == 1 and "peer 3 timed out" in s.failures[0]
    assert s.line() == (
        "jax_ub: traced ops: 3 cuda, 0 reference (auto=1, auto->pipeline=1, auto->ring=1, ring=1); "
        "40 CUDA op runs at 3.5 host us/op; 1 failure(s)"
    )
    d = _usage.as_dict(s)
    assert d["per_path"] == {"cuda": 3, "reference": 0} and d["failure_count"] == 1


def test_shutdown_logs_one_line(cpu_mesh, caplog):
    mesh = cpu_mesh(TP)
    x = jax.random.normal(jax.random.key(2), (TP * 2, 4))
    w = jax.random.normal(jax.random.key(3), (4, TP))
    jax.shard_map(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )(x, w)
    with caplog.at_level(logging.INFO, logger="jax_ub"):
        jax_ub.shutdown()
        jax_ub.shutdown()  # nothing new: not logged again
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("jax_ub: traced ops")]
    assert lines == ["jax_ub: traced ops: 0 cuda, 1 reference (xla=1); no CUDA op ran; 0 failure(s)"]
    assert [r.levelno for r in caplog.records if r.getMessage() in lines] == [logging.INFO]


def test_print_and_reset(capsys):
    _usage.record("ag", "xla")
    s = usage.summary(print_it=True)
    assert capsys.readouterr().out.strip() == str(s)
    usage.reset()
    assert jax_ub.summary().ops == {}
