"""FFI result types inside shard_map carry the inputs' varying mesh axes (check_vma=True).

A result typed invariant made autodiff psum the cotangents over the TP axis: on GPUs every gradient
through the CUDA path was off by the axis size (found by scripts/grad_probe.py on 4xH200).
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
            jnp.zeros((1,)))  # invariant baseline: empty
        seen["y"] = _ffi.result_type((3, 5), jnp.bfloat16, x, w)
        seen["ws"] = _ffi.result_type((16,), jnp.uint8, w)
        return x

    jax.shard_map(f, mesh=_mesh(), in_specs=(P("tp"), P("dp")), out_specs=P("tp"))(
        jnp.ones((8, 2)), jnp.ones((4, 2)))
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
