"""FFI result types inside shard_map carry the inputs' varying mesh axes (check_vma=True).

A result typed invariant made autodiff psum the cotangents over the TP axis: on GPUs every gradient
through the CUDA path was off by the axis size (found by lab-2026-11:scripts/grad_probe.py on 4xH200).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_ub import _ffi


def _mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


def test_result_type_is_varying_over_the_union_of_the_inputs():
    seen = {}

    def f(x, w):
        seen["xw"] = _ffi.varying_axes(jax.ShapeDtypeStruct((1,), jnp.float32)) | _ffi.varying_axes(
            jnp.zeros((1,))
        )  # invariant baseline: empty
        seen["y"] = _ffi.result_type((3, 5), jnp.bfloat16, x, w)
        seen["ws"] = _ffi.result_type((16,), jnp.uint8, w)
        return x

    jax.shard_map(f, mesh=_mesh(), in_specs=(P("tp"), P("dp")), out_specs=P("tp"))(
        jnp.ones((8, 2)), jnp.ones((4, 2))
    )
    assert seen["xw"] == frozenset()
    y = seen["y"]
    assert (y.shape, y.dtype) == ((3, 5), jnp.bfloat16)
    assert _ffi.varying_axes_of_type(y) == {"dp", "tp"}
    assert _ffi.varying_axes_of_type(seen["ws"]) == {"dp"}


def test_ffi_call_result_keeps_vma_under_check_vma():
    """An ffi_call typed with result_type passes shard_map's vma check for a varying output."""

    def f(x):
        t = _ffi.result_type(x.shape, x.dtype, x)
        return jax.ShapeDtypeStruct(t.shape, t.dtype), t

    out = {}

    def g(x):
        out["t"] = f(x)[1]
        return x * 2

    jax.shard_map(g, mesh=_mesh(), in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))(jnp.ones((8,)))
    assert _ffi.varying_axes_of_type(out["t"]) == {"dp", "tp"}


def test_tf32_follows_xlas_rule_whatever_the_spelling():
    """XLA lets a float32 GEMM use TF32 on NVIDIA GPUs at precision DEFAULT or HIGH; the CUDA path
    must not depend on how the same precision is written ("tensorfloat32" allowed TF32 while
    Precision.HIGH, the same level, did not). Dot algorithms: TF32's allows it, full-f32 or bf16
    ones get f32 (at least as precise as asked)."""
    from jax import lax

    allowed = [
        lax.Precision.DEFAULT,
        lax.Precision.HIGH,
        "default",
        "high",
        "HIGH",
        "tensorfloat32",
        "fastest",
        "bfloat16",
        "bfloat16_3x",
        ("high", "default"),
        lax.DotAlgorithmPreset.DEFAULT,
        lax.DotAlgorithmPreset.TF32_TF32_F32,
        "TF32_TF32_F32",
    ]
    forbidden = [
        lax.Precision.HIGHEST,
        "highest",
        "float32",
        ("high", "highest"),
        (lax.Precision.HIGHEST, lax.Precision.DEFAULT),
        lax.DotAlgorithmPreset.F32_F32_F32,
        "F32_F32_F32",
        lax.DotAlgorithmPreset.BF16_BF16_F32,
    ]
    assert [p for p in allowed if not _ffi.tf32_allowed(p)] == []
    assert [p for p in forbidden if _ffi.tf32_allowed(p)] == []
    # Every spelling of one level agrees with the others (jax's own canonical form).
    for level, names in (
        (lax.Precision.HIGH, ("high", "tensorfloat32", "bfloat16_3x")),
        (lax.Precision.HIGHEST, ("highest", "float32")),
        (lax.Precision.DEFAULT, ("default", "fastest", "bfloat16")),
    ):
        assert {_ffi.tf32_allowed(n) for n in names} == {_ffi.tf32_allowed(level)}, level
        assert all(lax.Precision(n) == level for n in names)
    with jax.default_matmul_precision("highest"):
        assert not _ffi.tf32_allowed(None)
    with jax.default_matmul_precision("tensorfloat32"):
        assert _ffi.tf32_allowed(None)
