"""``jax_ub.explain`` and ``method="auto"`` say what a call runs: on transport nccl the NCCL schedule,
with ``JAX_UB_METHOD``/``method=`` the method asked for, the op's own refusals, the global shape.
The CUDA path is simulated (``_ext.cuda_path_available`` and a communicator set stand-in)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

import jax_ub
from jax_ub import _ext, _validate, choice, comm, config, methods, ops, overlap, resolve, schedule

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16
AG_X, AG_W = S((2048, 8192), BF), S((8192, 2048), BF)  # tp 4: global 8192x8192x8192
RS_X, RS_W = S((8192, 2048), BF), S((2048, 8192), BF)
CALL_AG = "; global 8192x8192x8192, tp=4 (call x [2048, 8192] @ w [8192, 2048])"


@pytest.fixture
def cuda(monkeypatch):
    """``cuda(transport)``: the CUDA path is available and axis "tp" has a 4-GPU communicator set."""

    def install(transport="ipc"):
        monkeypatch.setattr(_ext, "cuda_path_available", lambda: (True, ""))
        monkeypatch.setitem(comm._sets, "tp", types.SimpleNamespace(world=4, transport=transport, axis="tp"))

    return install


def test_explain_is_exported():
    assert jax_ub.explain is resolve.explain is overlap.explain and "explain" in jax_ub.__all__


def test_auto_on_transport_nccl_is_the_nccl_schedule(cuda):
    cuda("nccl")
    for op, x, w in (("ag", AG_X, AG_W), ("rs", RS_X, RS_W)):
        got = jax_ub.explain(op, x, w)
        assert got.startswith("nccl: the NCCL schedule runs: axis 'tp' has transport nccl"), got
        assert "no measurement compares it with xla" in got
        assert overlap.choose(op, x.shape, w.shape, BF, "tp") == "nccl"
    got = jax_ub.explain("rs", RS_X, RS_W, method="columns")
    assert got.startswith("nccl: requested columns (method='columns'), but the NCCL schedule runs")


def test_auto_runs_the_nccl_schedule_on_transport_nccl(cuda, monkeypatch):
    """What auto dispatches to, not only what it says: a CUDA method, whose kernel the axis's
    transport runs as the NCCL schedule (the op's default schedule's code, which NCCL ignores)."""
    cuda("nccl")
    monkeypatch.setattr(_validate, "bound_by_shard_map", lambda axis_name: True)
    for op, x, w in ((ops.AG, AG_X, AG_W), (ops.RS, RS_X, RS_W)):
        assert resolve.auto_method(op, x, w, "tp") == methods.DEFAULT[op]
    seen = []
    monkeypatch.setitem(ops._CUDA, ops.AG, lambda x, w, method, **kw: seen.append(method) or (x @ w, None))
    x, w = jnp.ones((8, 16), BF), jnp.ones((16, 4), BF)
    call = ops._call_for(ops.AG, "auto", "tp", 0, None, x, w, return_full=False)
    ops._forward(call, x, w, need_full=False)
    assert seen == [methods.DEFAULT[ops.AG]]


def test_rs_on_transport_nccl_is_not_cut_into_pieces():
    """The NCCL schedule computes whole partials: no split GEMM shapes to prepare (ring would split
    here)."""
    assert schedule.rs_splits("ring", 4096, 4096, 2) == 2
    assert schedule.rs_splits("nccl", 4096, 4096, 2) == 1


def test_auto_on_ipc_says_the_choice_and_the_global_shape(cuda):
    cuda("ipc")
    c = choice.choose("ag", 4, "bfloat16", 8192, 8192, 8192, config.get().tuning_file)
    assert jax_ub.explain("ag", AG_X, AG_W) == f"{c.method}: {c.why}{CALL_AG}"
    got = jax_ub.explain("ag", S((4, 512, 8192), BF), AG_W, axis=1)  # leading dims fold into M
    assert got.endswith("; global 8192x8192x8192, tp=4 (call x [4, 512, 8192] @ w [8192, 2048])")


def test_a_configured_or_requested_method_is_what_runs(cuda):
    cuda("ipc")
    auto = overlap.choose("ag", AG_X.shape, AG_W.shape, BF, "tp")
    with config.override(method="ring"):
        assert (
            jax_ub.explain("ag", AG_X, AG_W)
            == f"ring: requested (JAX_UB_METHOD=ring); auto would run {auto}{CALL_AG}"
        )
        # method= wins over JAX_UB_METHOD, as in the op
        assert jax_ub.explain("ag", AG_X, AG_W, method="auto").startswith(f"{auto}: nearest measured shape")
    with config.override(method="chain"):
        assert jax_ub.explain("ag", AG_X, AG_W).startswith(
            "push: requested (JAX_UB_METHOD=chain) (for all_gather_matmul, chain is the push algorithm)"
        )
    assert jax_ub.explain("rs", RS_X, RS_W, method="all_peer").startswith(
        "pipeline: requested (method='all_peer') "
        "(for matmul_reduce_scatter, all_peer is the pipeline algorithm)"
    )
    # push_merge runs push's kernel with another schedule: named as itself for the all-gather
    assert jax_ub.explain("ag", AG_X, AG_W, method="push_merge").startswith(
        "push_merge: requested (method='push_merge');"
    )
    assert jax_ub.explain("rs", RS_X, RS_W, method="push_merge").startswith(
        "ring: requested (method='push_merge') (for matmul_reduce_scatter, push_merge is the ring algorithm)"
    )
    assert jax_ub.explain("ag", AG_X, AG_W, method="xla") == f"xla: requested (method='xla'){CALL_AG}"
    with config.override(disable=True):
        assert jax_ub.explain("ag", AG_X, AG_W, method="ring") == (
            f"xla: JAX_UB_DISABLE=1 forces the pure-XLA reference path{CALL_AG}"
        )
    with (
        pytest.raises(
            ValueError,
            match=r"explain\('ag'\): method='nccl' needs jax_ub.initialize\(mesh, "
            r"axis='tp', transport='nccl'\); this axis was initialized with "
            r"transport 'ipc'",
        ),
        pytest.warns(DeprecationWarning, match="method='nccl' is deprecated"),
    ):
        jax_ub.explain("ag", AG_X, AG_W, method="nccl")
    with pytest.raises(ValueError, match="`method` must be None or one of"):
        jax_ub.explain("ag", AG_X, AG_W, method="rign")


def test_explain_refuses_what_the_op_refuses(cuda):
    cuda("ipc")
    with pytest.raises(
        ValueError,
        match=r"explain\('rs'\): x.shape\[scatter_axis=0\] must be divisible by "
        r"the size of mesh axis 'tp' \(4\); got x \[3, 2048\]",
    ):
        jax_ub.explain("rs", S((3, 2048), BF), RS_W)
    with pytest.raises(ValueError, match=r"x.shape\[gather_axis=0\] is 0 .*XLA cannot all-gather"):
        jax_ub.explain("ag", S((0, 8192), BF), AG_W)
    with pytest.raises(
        ValueError,
        match=r"explain\('ag'\): method='ring' needs a jax_ub communicator, and the "
        r"call would fail: no jax_ub communicator for axis 'model'",
    ):
        jax_ub.explain("ag", AG_X, AG_W, axis_name="model", method="ring")
    assert jax_ub.explain("ag", AG_X, AG_W, axis_name="model").startswith(
        "xla: no jax_ub communicator for axis 'model'"
    )


def test_a_zero_size_operand_runs_the_reference(cuda):
    cuda("ipc")
    assert jax_ub.explain("ag", S((8, 0), BF), S((0, 2048), BF)) == (
        "xla: zero-size operand [8, 0], [0, 2048] (nothing to overlap: the reference runs); "
        "global 32x0x8192, tp=4 (call x [8, 0] @ w [0, 2048])"
    )


def test_a_cuda_method_without_the_cuda_path_raises_as_the_op_does(monkeypatch):
    monkeypatch.setattr(_ext, "cuda_path_available", lambda: (False, "jax has no CUDA GPU (stand-in)"))
    assert (
        jax_ub.explain("ag", AG_X, AG_W)
        == "xla: jax has no CUDA GPU (stand-in) (call x [2048, 8192] @ w [8192, 2048])"
    )
    with pytest.raises(
        ValueError,
        match=r"method='ring' needs the CUDA overlap extension, which is not "
        r"available: jax has no CUDA GPU \(stand-in\)",
    ):
        jax_ub.explain("ag", AG_X, AG_W, method="ring")


@pytest.mark.parametrize(
    "axis_name, exc, fragment",
    [
        (0, TypeError, "`axis_name` must be a mesh axis name (str) or a tuple of names; got 0"),
        (["tp"], TypeError, "`axis_name` must be a mesh axis name (str) or a tuple of names; got ['tp']"),
        (("tp", "tp"), ValueError, "names an axis more than once"),
    ],
)
def test_explain_checks_axis_name_as_the_op_does(axis_name, exc, fragment):
    """It answered "xla: ..." for axis names the op refuses (and, with a communicator, said an int
    "names several mesh axes")."""
    with pytest.raises(exc) as info:
        jax_ub.explain("ag", AG_X, AG_W, axis_name)
    assert str(info.value).startswith("explain('ag'): ") and fragment in str(info.value), str(info.value)


def test_explain_takes_a_tuple_of_one_axis_as_its_name(cuda):
    """As the op does: ("tp",) is "tp", whose communicator decides (not "names several axes")."""
    cuda("ipc")
    by_name = jax_ub.explain("ag", AG_X, AG_W, "tp")
    assert jax_ub.explain("ag", AG_X, AG_W, ("tp",)) == by_name
    assert "tp=4" in by_name and "several" not in by_name
