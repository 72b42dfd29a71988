"""Never silently slow: on a mesh of CUDA GPUs where jax_ub's CUDA path cannot run, the first
``method="auto"`` op raises naming the reason and the fix, unless the reference path was asked for
(``method="xla"``, ``JAX_UB_DISABLE=1``) or allowed (``JAX_UB_ALLOW_REFERENCE=1``).

A CUDA GPU mesh is simulated on the host devices: the platform check (the enclosing mesh's
platform, jax's CUDA backend) is patched to say GPU; the CUDA path's state (extension not built,
driver too old, available but no communicator) is patched in :mod:`jax_ub._ext`. Values that do
run are checked against float64 NumPy on random inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import _ext, _usage, _validate, config, resolve

TP = 4
NOT_INSTALLED = "jax_ub is not installed (no _jax_ub_build module): run `pip install .` from the checkout"
NOT_BUILT = "the build found no nvcc (CUDACXX unset, none on PATH)"


@pytest.fixture(autouse=True)
def _fresh_usage():
    _usage.reset()
    yield
    _usage.reset()


@pytest.fixture
def gpu_mesh(monkeypatch, cpu_mesh):
    """A TP mesh of host devices that jax_ub's platform check takes for CUDA GPUs."""
    monkeypatch.setattr(_validate, "mesh_platform", lambda: "gpu")
    monkeypatch.setattr(_ext, "cuda_backend", lambda: "cuda")
    monkeypatch.setattr(_ext, "_gpu_backend", lambda: "cuda")
    return cpu_mesh(TP)


def _unavailable(monkeypatch, reason: str) -> None:
    """The extension does not load, for ``reason``."""
    monkeypatch.setattr(_ext, "_load", lambda: (None, reason))


class _OldDriverExtension:
    """An extension built with CUDA 13.0 seeing a CUDA 12.8 driver."""

    def runtime_info(self):
        return {"driver_version": 12080, "error": "cudaErrorInsufficientDriver"}

    def build_info(self):
        return {"cuda_runtime_version": 13000}


def _operands(seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (TP * 8, 16), jnp.float32)  # rows sharded over tp
    w = jax.random.normal(kw, (16, TP * 6), jnp.float32)  # columns sharded over tp
    return x, w


def _ag(mesh, **kw):
    return jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", **kw),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )


def _rs(mesh, **kw):
    return jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", **kw),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
        )
    )


def _want(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _check_refusal(err: str, *needles: str) -> None:
    for n in (*needles, "CUDA GPUs", "method='xla'", "JAX_UB_ALLOW_REFERENCE=1"):
        assert n in err, (n, err)


@pytest.mark.parametrize(
    "reason, fix",
    [
        (NOT_INSTALLED, "pip install ."),  # the reason names its fix
        (NOT_BUILT, "python -m jax_ub.doctor"),  # the generic fix: doctor, then a build that says why
    ],
)
def test_auto_without_the_extension_raises_with_reason_and_fix(monkeypatch, gpu_mesh, reason, fix):
    _unavailable(monkeypatch, reason)
    x, w = _operands()
    with pytest.raises(resolve.CudaPathUnavailableError) as e:
        _ag(gpu_mesh)(x, w)
    _check_refusal(str(e.value), "all_gather_matmul", reason, fix)
    if fix.startswith("python"):
        assert "JAX_UB_REQUIRE_CUDA=1" in str(e.value)
    s = jax_ub.summary()
    assert s.failure_count == 1 and reason in s.failures[0]
    assert s.per_path() == {"cuda": 0, "reference": 0}  # nothing ran


def test_rs_and_bulk_refuse_too(monkeypatch, gpu_mesh):
    _unavailable(monkeypatch, NOT_BUILT)
    x, w = _operands(1)
    with pytest.raises(resolve.CudaPathUnavailableError, match="matmul_reduce_scatter"):
        _rs(gpu_mesh)(x, w[:, :5])
    bulk = jax.jit(
        jax.shard_map(
            lambda x, a, b: jax_ub.bulk_all_gather(x, a, b, "tp"),
            mesh=gpu_mesh,
            in_specs=(P("tp"), P(), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    with pytest.raises(resolve.CudaPathUnavailableError, match="bulk_all_gather"):
        bulk(x, w[:8, :5], w[:5, :7])


def test_driver_too_old_names_the_driver_and_rebuild(monkeypatch, gpu_mesh):
    monkeypatch.setattr(_ext, "_load", lambda: (_OldDriverExtension(), ""))
    x, w = _operands(2)
    with pytest.raises(resolve.CudaPathUnavailableError) as e:
        _ag(gpu_mesh)(x, w)
    _check_refusal(str(e.value), "built with CUDA 13.0", "supports CUDA 12.8", "rebuild jax_ub")
    assert "jax_ub.doctor" not in str(e.value)  # the reason carries its own fix


def test_no_communicator_for_the_axis(monkeypatch, gpu_mesh):
    """The CUDA path can run, but initialize was not called for the axis."""
    monkeypatch.setattr(_ext, "cuda_path_available", lambda: (True, ""))
    x, w = _operands(3)
    with pytest.raises(resolve.CudaPathUnavailableError) as e:
        _ag(gpu_mesh)(x, w)
    _check_refusal(str(e.value), "no jax_ub communicator", "jax_ub.initialize(mesh, axis='tp')")
    with pytest.raises(resolve.CudaPathUnavailableError, match=r"initialize\(mesh, axis='tp'\)"):
        jax_ub.explain(
            "ag", jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 6), jnp.float32)
        )


def test_opt_ins_run_the_reference(monkeypatch, gpu_mesh):
    """method='xla', JAX_UB_DISABLE=1 and JAX_UB_ALLOW_REFERENCE=1 run the reference: right values."""
    _unavailable(monkeypatch, NOT_BUILT)
    x, w = _operands(4)
    want = _want(x, w)
    np.testing.assert_allclose(np.asarray(_ag(gpu_mesh, method="xla")(x, w)), want, rtol=1e-5, atol=1e-4)
    with config.override(disable=True):
        np.testing.assert_allclose(np.asarray(_ag(gpu_mesh)(x, w)), want, rtol=1e-5, atol=1e-4)
    assert jax_ub.summary().gpu_reference == 0  # asked for: not counted as allowed fallbacks
    with config.override(allow_reference=True):
        got = _ag(gpu_mesh)(x, w)
        y = jnp.asarray(np.random.default_rng(4).normal(size=(TP * 8, 12)), jnp.float32)
        got_rs = _rs(gpu_mesh)(y, w[:12, :7])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_rs), _want(y, w[:12, :7]), rtol=1e-5, atol=1e-4)
    s = jax_ub.summary()
    assert s.gpu_reference == 2 and s.failure_count == 0
    assert "2 on a CUDA GPU mesh, JAX_UB_ALLOW_REFERENCE=1" in s.line()


def test_cpu_mesh_runs_the_reference_as_normal(monkeypatch, cpu_mesh):
    """The same unavailable extension on a CPU mesh: the reference is the normal path there."""
    _unavailable(monkeypatch, NOT_BUILT)
    x, w = _operands(5)
    got = _ag(cpu_mesh(TP))(x, w)
    np.testing.assert_allclose(np.asarray(got), _want(x, w), rtol=1e-5, atol=1e-4)
    s = jax_ub.summary()
    assert s.failure_count == 0 and s.gpu_reference == 0 and s.per_path()["reference"] == 1


def test_setting_is_documented():
    with open("docs/configuration.md") as f:
        doc = f.read()
    assert "JAX_UB_ALLOW_REFERENCE" in doc and config.Config().allow_reference is False
