"""CPU tier: what shutdown() does to programs traced while a communicator existed.

A traced program names its communicator set in its custom calls; once shutdown() frees that set,
the cached executable would fail on its next call. shutdown() therefore clears JAX's caches where
it freed a set, so the function is traced anew (here faked: CPU has no communicator).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ub import _ext, _validate
from jax_ub.comm import bootstrap, nccl
from jax_ub.comm import lifecycle as comm  # where its state lives: the tests rebind _sets, _abandoned


class FakeCommExtension:
    def __init__(self):
        self.calls = []

    def comm_drain(self, set_id):
        self.calls.append(("drain", set_id))

    def comm_destroy_set(self, set_id):
        self.calls.append(("destroy", set_id))

    def nccl_comm_destroy(self, key):
        self.calls.append(("nccl_destroy", key))
        return 0


def _fake_set(set_id: int, axis: str) -> comm.CommSet:
    return comm.CommSet(
        set_id=set_id,
        init_id=0,
        axis=axis,
        world=2,
        groups=[[None, None]],
        local=[(0, 0, 0), (1, 0, 1)],
        capacity=1 << 20,
        timeout_s=1.0,
        transport="ipc",
        exchange=None,
    )


def test_shutdown_retraces_programs_only_where_it_freed_a_set(monkeypatch):
    fake = FakeCommExtension()
    monkeypatch.setattr(_ext, "extension", lambda: fake)
    monkeypatch.setattr(nccl, "_extension", lambda: (fake, ""))
    monkeypatch.setattr(comm, "_sets", {})
    traces = []

    @jax.jit
    def f(x):
        traces.append(x.shape)
        return x * 2

    x = jnp.arange(4.0)
    f(x), f(x)
    assert len(traces) == 1
    comm.shutdown()  # nothing to free: the compiled program stays
    comm.shutdown("tp")
    assert (f(x) == 2 * x).all() and len(traces) == 1 and fake.calls == []

    comm._sets["tp"] = _fake_set(41, "tp")
    comm._sets["dp"] = _fake_set(42, "dp")
    comm.shutdown("tp")
    assert ("destroy", 41) in fake.calls and ("destroy", 42) not in fake.calls
    assert (f(x) == 2 * x).all() and len(traces) == 2, traces  # traced again
    assert list(comm._sets) == ["dp"]
    comm.shutdown()
    assert ("destroy", 42) in fake.calls and comm._sets == {}
    f(x)
    assert len(traces) == 3, traces


def _install_failing_drain(monkeypatch) -> FakeCommExtension:
    """The stand-in extension, its comm_drain failing as after a peer timeout."""
    fake = FakeCommExtension()

    def drain(set_id):
        raise RuntimeError(f"jax_ub: set {set_id} has a sticky error")

    fake.comm_drain = drain
    monkeypatch.setattr(_ext, "extension", lambda: fake)
    monkeypatch.setattr(nccl, "_extension", lambda: (fake, ""))
    return fake


def test_shutdown_clears_caches_even_when_draining_failed(monkeypatch):
    fake = _install_failing_drain(monkeypatch)
    monkeypatch.setattr(comm, "_sets", {"tp": _fake_set(7, "tp")})
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return x + 1

    f(jnp.ones(3))
    with pytest.raises(RuntimeError, match="set 7 has a sticky error"):
        comm.shutdown()
    assert ("destroy", 7) in fake.calls and comm._sets == {}
    f(jnp.ones(3))
    assert len(traces) == 2


def _exchanges(world: int, timeout_s: float = 5.0):
    store = bootstrap.LocalStore()
    return [
        bootstrap.KVExchange(
            "jax_ub/test/outcome",
            p,
            world,
            timeout_s,
            client=store,
            peer_names=[f"process {q}" for q in range(world)],
        )
        for p in range(world)
    ]


def test_a_failed_cleanup_does_not_hide_why_initialize_gave_up(monkeypatch, caplog):
    fake = FakeCommExtension()

    def destroy_set(set_id):
        raise RuntimeError("cudaFree failed")

    fake.comm_destroy_set = destroy_set
    monkeypatch.setattr(_ext, "extension", lambda: fake)
    monkeypatch.setattr(nccl, "_extension", lambda: (fake, ""))
    with caplog.at_level("ERROR", logger="jax_ub"):
        comm._destroy_quietly(_fake_set(9, "tp"))
    assert "freeing the communicators of set 9 after a failure also failed: cudaFree failed" in caplog.text
    # the NCCL communicators are still freed after the failed destroy
    assert ("nccl_destroy", comm._BOOTSTRAP_KEY + 9) in fake.calls and ("nccl_destroy", 9) in fake.calls


def test_shutdown_keeps_buffers_a_missing_peer_may_still_write(monkeypatch):
    """shutdown()'s barrier timed out: a peer may still be inside an op writing into this
    process's buffers, so they are not freed, and the error says so (and keeps the drain error)."""
    fake = _install_failing_drain(monkeypatch)
    s = _fake_set(5, "tp")
    s.exchange = _exchanges(2, timeout_s=0.3)[0]  # process 1 never arrives
    monkeypatch.setattr(comm, "_sets", {"tp": s})
    monkeypatch.setattr(comm, "_abandoned", [])
    with pytest.raises(RuntimeError) as info:
        comm.shutdown("tp")
    msg = str(info.value)
    assert "jax_ub.shutdown(axis='tp')" in msg and "rank 1 (process 1)" in msg, msg
    assert "set 5 stay allocated" in msg and "set 5 has a sticky error" in msg, msg
    assert ("destroy", 5) not in fake.calls and comm._abandoned == [s] and comm._sets == {}


def test_one_axis_names_the_communicators_axis():
    assert _validate.one_axis("tp") == "tp"
    assert _validate.one_axis(("tp",)) == "tp" and _validate.one_axis(["tp"]) is None
    assert _validate.one_axis(("dp", "tp")) is None and _validate.one_axis(None) is None


def test_initialize_refuses_several_axes(cpu_mesh):
    mesh = cpu_mesh(2, dp=2)
    with pytest.raises(
        TypeError,
        match=r"`axis` must be the name of one mesh axis \(a str\); "
        r"got \('dp', 'tp'\)",
    ):
        comm.initialize(mesh, ("dp", "tp"))


@pytest.mark.parametrize(
    "kw,exc,fragment",
    [
        (dict(timeout_s=-1), ValueError, "timeout_s must be a finite number of seconds >= 0.001; got -1.0"),
        (dict(timeout_s=float("nan")), ValueError, "timeout_s must be a finite number of seconds >= 0.001"),
        (
            dict(timeout_s=1e-4),
            ValueError,
            "timeout_s must be a finite number of seconds >= 0.001; got 0.0001",
        ),
        (dict(timeout_s="soon"), TypeError, "timeout_s must be a number; got 'soon'"),
        (
            dict(buffer_mib=-5),
            ValueError,
            "buffer_mib must be in [0, 1048576] (MiB per GPU; 1048576 is 1 TiB); got -5",
        ),
        # Numbers only (Config refuses strings too), and no size a GPU cannot have: 2**70 MiB would
        # overflow the extension's size_t, far from a jax_ub message.
        (dict(timeout_s="5"), TypeError, "timeout_s must be a number; got '5'"),
        (dict(buffer_mib="4"), TypeError, "buffer_mib must be an int; got '4'"),
        (
            dict(buffer_mib=2**70),
            ValueError,
            f"buffer_mib must be in [0, 1048576] (MiB per GPU; 1048576 is 1 TiB); got {2**70}",
        ),
        (dict(buffer_mib=1.5), TypeError, "buffer_mib must be an int; got 1.5"),
        (dict(buffer_mib=True), TypeError, "buffer_mib must be an int; got True"),
    ],
)
def test_initialize_checks_its_numbers_everywhere(cpu_mesh, kw, exc, fragment):
    """Checked before anything else, so a CPU run finds the mistake a GPU run would hit."""
    with pytest.raises(exc) as info:
        comm.initialize(cpu_mesh(2), "tp", **kw)
    assert f"initialize: {fragment}" in str(info.value)


@pytest.mark.parametrize("mesh", ["tp", None, np.zeros(2)], ids=["str", "none", "ndarray"])
def test_initialize_needs_a_mesh(mesh):
    with pytest.raises(TypeError, match=r"initialize: `mesh` must be a jax.sharding.Mesh .*got "):
        comm.initialize(mesh, "tp")


def test_initialize_takes_a_tuple_of_one_axis(cpu_mesh):
    assert comm.initialize(cpu_mesh(2), ("tp",)) is None  # no CUDA path here: nothing to create


def test_a_tuple_of_one_axis_finds_its_communicator(monkeypatch):
    s = _fake_set(3, "tp")
    monkeypatch.setattr(comm, "_sets", {"tp": s})
    assert comm.get(("tp",)) is s and comm.get("tp") is s
    assert comm.get(("dp", "tp")) is None


def test_cuda_method_over_several_axes_says_why(monkeypatch):
    from jax_ub import overlap

    monkeypatch.setattr(comm, "_sets", {"tp": _fake_set(3, "tp")})
    with pytest.raises(
        ValueError,
        match=r"all_gather_matmul: method='ring' runs over one mesh axis, "
        r"and axis_name \('dp', 'tp'\) names several",
    ):
        overlap._set_for(("dp", "tp"), "all_gather_matmul", "ring")
    with pytest.raises(ValueError, match=r"bulk_all_gather: the CUDA path runs over one mesh axis"):
        overlap._set_for(("dp", "tp"), "bulk_all_gather")


def test_auto_over_several_axes_warns_without_initialize_advice(monkeypatch, caplog):
    monkeypatch.setattr(_validate, "mesh_platform", lambda: "gpu")
    monkeypatch.setattr(comm, "_warned_axes", set())
    with caplog.at_level("WARNING", logger="jax_ub"):
        comm.warn_no_communicator("all_gather_matmul", ("dp", "tp"))
        comm.warn_no_communicator("all_gather_matmul", ("dp", "tp"))  # once per axes
        comm.warn_no_communicator("all_gather_matmul", "sp")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "names several mesh axes" in msgs[0] and "initialize" not in msgs[0], msgs[0]
    assert "jax_ub.initialize(mesh, axis='sp')" in msgs[1], msgs[1]


def test_vmap_axis_is_not_a_shard_map_axis(cpu_mesh):
    """A jax.vmap axis named like the TP axis is no mesh axis: the CUDA path (one rank per mesh
    device) must not take it, whatever communicator exists under that name."""
    seen = {}

    def probe(tag):
        def f(x):
            seen[tag] = _validate.bound_by_shard_map("tp")
            return x

        return f

    mesh = cpu_mesh(4)
    x = jnp.ones((4, 3))
    jax.vmap(probe("vmap"), axis_name="tp")(x)
    jax.jit(jax.shard_map(probe("shard_map"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)
    jax.jit(
        jax.vmap(jax.shard_map(probe("shard_map_in_vmap"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    )(jnp.ones((2, 4, 3)))
    assert seen == {"vmap": False, "shard_map": True, "shard_map_in_vmap": True}


def test_cuda_method_refuses_a_vmap_axis(monkeypatch):
    from jax_ub import overlap

    monkeypatch.setattr(comm, "_sets", {"tp": _fake_set(3, "tp")})
    caught = []

    def f(x):
        try:
            overlap._set_for("tp", "all_gather_matmul", "ring")
        except ValueError as e:
            caught.append(str(e))
        return x

    jax.vmap(f, axis_name="tp")(jnp.ones((2, 3)))
    assert caught and "axis_name 'tp' is bound here by jax.vmap (or pmap)" in caught[0], caught
    assert "method='ring' needs the shard_map" in caught[0], caught


def test_shutdown_of_an_axis_no_initialize_named_says_so(cpu_mesh, caplog):
    """A misspelt axis frees nothing: shutdown says which axes were initialized (and stays quiet
    for an initialized axis shut down twice); an axis that is not a name is refused."""
    for bad in (3, ("tp", "dp")):
        with pytest.raises(
            TypeError,
            match=r"axis must be a mesh axis name \(str\), a tuple of one, or "
            r"None .*got " + re.escape(repr(bad)),
        ):
            comm.shutdown(bad)
    comm.initialize(cpu_mesh(2), "tp")  # the reference path on CPU: no set, but a named axis
    with caplog.at_level("WARNING", logger="jax_ub"):
        comm.shutdown("tq")
    assert "shutdown(axis='tq'): no jax_ub.initialize() named this axis" in caplog.text
    assert "'tp'" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="jax_ub"):
        comm.shutdown(("tp",))  # a tuple of one axis, as initialize and the ops take it
        comm.shutdown("tp")
    assert "no jax_ub.initialize() named" not in caplog.text, caplog.text
