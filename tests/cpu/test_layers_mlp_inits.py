"""CPU tier: per-projection initializers of ParallelMLP (NNX and linen).

``up_kernel_init`` / ``down_kernel_init`` / ``up_bias_init`` / ``down_bias_init`` default to the
shared ``kernel_init`` / ``bias_init``; given, each goes to its projection alone: a smaller scale
on ``down`` (GPT-2's ``1/sqrt(2 * layers)``), FSDP names on the dim each projection keeps whole.
Numbers are checked against the plain unsharded float32 computation.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest
from _layer_helpers import (
    HIGHEST,
    NORMAL,
    B,
    F,
    H,
    S,
    assert_close,
    data,
    fsdp_mesh,
    nnx_fn,
    on_cpu,  # noqa: F401  (autouse fixture)
    param_specs,
    plain_mlp,
    pure,
    value_and_grads,
)
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ub import linen as ubl
from jax_ub import nn as ubnn

LECUN = nnx.initializers.lecun_normal()
LAYERS = 8
SCALE = (2 * LAYERS) ** -0.5


def scaled(init, scale):
    return lambda key, shape, dtype=jax.numpy.float32: scale * init(key, shape, dtype)


SWIGLU = dict(gated=True, activation=jax.nn.silu)


def oracle(gated):
    return lambda p, x: plain_mlp(p, x, gated=gated)


def linen_params(model, x):
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_down_scaled_alone(cpu_mesh, gated):
    """``down_kernel_init`` = the shared init scaled: ``down.kernel`` is exactly the scaled one
    (same key), everything else is the default model's, and the model computes with them."""
    mesh = cpu_mesh(4, dp=2)
    kw = dict(precision=HIGHEST, bias_init=NORMAL, **(SWIGLU if gated else {}))
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    with jax.set_mesh(mesh):
        base = pure(ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(0), **kw))
        mlp = ubnn.ParallelMLP(H, F, down_kernel_init=scaled(LECUN, SCALE), rngs=nnx.Rngs(0), **kw)
        params = pure(mlp)
        got, got_g = value_and_grads(nnx_fn(mlp), params, x, ct)
        lbase = linen_params(ubl.ParallelMLP(F, **kw), x)
        lmodel = ubl.ParallelMLP(F, down_kernel_init=scaled(LECUN, SCALE), **kw)
        lparams = linen_params(lmodel, x)
        lgot, lgot_g = value_and_grads(lambda p, x: lmodel.apply({"params": p}, x), lparams, x, ct)
    for new, old, y, g in ((params, base, got, got_g), (lparams, lbase, lgot, lgot_g)):
        new = jax.device_get(new)
        want, want_g = value_and_grads(oracle(gated), new, x, ct)
        assert_close(y, want)
        assert_close(g, want_g)
        assert_close(new["down"]["kernel"], SCALE * old["down"]["kernel"], rtol=0, atol=0)
        new["down"]["kernel"] = old["down"]["kernel"]
        assert_close(new, old, rtol=0, atol=0)


def test_default_is_the_shared_init_bit_for_bit(cpu_mesh):
    """Naming each projection's initializer as the shared one changes no bit."""
    x = data(B, S, H)
    shared = dict(kernel_init=LECUN, bias_init=NORMAL)
    each = dict(
        shared, up_kernel_init=LECUN, down_kernel_init=LECUN, up_bias_init=NORMAL, down_bias_init=NORMAL
    )
    with jax.set_mesh(cpu_mesh(4)):
        a, b = (ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(5), **kw) for kw in (shared, each))
        assert_close(pure(a), pure(b), rtol=0, atol=0)
        assert_close(nnx.jit(lambda m, x: m(x))(a, x), nnx.jit(lambda m, x: m(x))(b, x), rtol=0, atol=0)
        assert_close(
            linen_params(ubl.ParallelMLP(F, **shared), x),
            linen_params(ubl.ParallelMLP(F, **each), x),
            rtol=0,
            atol=0,
        )


FSDP_SPECS = {
    "up": {"kernel": P("fsdp", "tp"), "bias": P("tp")},
    "down": {"kernel": P("tp", "fsdp"), "bias": P("fsdp")},
}


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_nnx_fsdp_names_per_projection(cpu_mesh, explicit, gated):
    mesh = fsdp_mesh(cpu_mesh, tp=4, explicit=explicit)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    with jax.set_mesh(mesh):
        mlp = ubnn.ParallelMLP(
            H,
            F,
            precision=HIGHEST,
            up_kernel_init=nnx.with_partitioning(LECUN, ("fsdp", None)),
            down_kernel_init=nnx.with_partitioning(LECUN, (None, "fsdp")),
            bias_init=NORMAL,
            down_bias_init=nnx.with_partitioning(NORMAL, ("fsdp",)),
            rngs=nnx.Rngs(0),
            **(SWIGLU if gated else {}),
        )
        specs = param_specs(mlp)
        params = pure(mlp)
        got, got_g = value_and_grads(nnx_fn(mlp), params, x, ct)
    assert {k: specs[k] for k in FSDP_SPECS} == FSDP_SPECS
    assert {k: jax.tree.map(lambda a: a.sharding.spec, params[k]) for k in FSDP_SPECS} == FSDP_SPECS
    want, want_g = value_and_grads(oracle(gated), jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_linen_fsdp_names_per_projection(cpu_mesh, gated):
    mesh = fsdp_mesh(cpu_mesh, tp=4)
    x, ct = data(B, S, H), data(B, S, H, seed=2)
    model = ubl.ParallelMLP(
        F,
        precision=HIGHEST,
        up_kernel_init=nn.with_partitioning(LECUN, ("fsdp", None)),
        down_kernel_init=nn.with_partitioning(LECUN, (None, "fsdp")),
        bias_init=NORMAL,
        down_bias_init=nn.with_partitioning(NORMAL, ("fsdp",)),
        **(SWIGLU if gated else {}),
    )
    with jax.set_mesh(mesh):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        specs = nn.get_partition_spec(variables)["params"]
        shardings = jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s), nn.get_partition_spec(variables)
        )
        params = nn.unbox(jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x))["params"]
        got, got_g = value_and_grads(lambda p, x: model.apply({"params": p}, x), params, x, ct)
    assert {k: specs[k] for k in FSDP_SPECS} == FSDP_SPECS
    assert {k: jax.tree.map(lambda a: a.sharding.spec, params[k]) for k in FSDP_SPECS} == FSDP_SPECS
    want, want_g = value_and_grads(oracle(gated), jax.device_get(params), x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_shared_fsdp_init_cannot_serve_both_and_the_error_says_which(cpu_mesh):
    """One ``kernel_init`` with ``("fsdp", None)`` fits ``up`` but not ``down`` (whose dim 0 is the
    TP dim): the error names the sub-layer's parameter, and a note the MLP's initializer."""
    msg = r"RowParallelDense: kernel_init's partitioning \('fsdp', None\) names 'fsdp' on dim 0 of `kernel`"
    with jax.set_mesh(fsdp_mesh(cpu_mesh, tp=4)), pytest.raises(ValueError, match=msg) as e:
        ubnn.ParallelMLP(H, F, kernel_init=nnx.with_partitioning(LECUN, ("fsdp", None)), rngs=nnx.Rngs(0))
    assert e.value.__notes__ == [
        "While building ParallelMLP.down: its `kernel` is from kernel_init "
        "(no down_kernel_init given), its `bias` from bias_init (no "
        "down_bias_init given)."
    ]
