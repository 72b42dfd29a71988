"""The NaN poison of the GPU tiers reaches an output that nobody writes.

Every GPU test of an op calls ``tests._checks.poison`` right before it: NaN buffers of the output's
shape, freed, so that XLA's allocator hands one of those blocks to the op's output and an element
the op leaves unwritten reads NaN. Nothing in XLA promises that reuse. Here a custom call that
writes nothing (the extension's ``jax_ub_test_unwritten``) stands in for an op that forgets its
whole output: if the allocator ever stopped handing the block back, these tests fail, instead of
every "no NaN in the output" check silently checking nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests import _checks  # noqa: E402
from tests._gpus import extension  # noqa: E402

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU

# Output shapes the GPU tiers poison for (test_gemm's, test_overlap's, the worker's), small to large.
SHAPES = [
    ((3, 7), jnp.bfloat16),
    ((2, 3, 40, 24), jnp.float16),
    ((1536, 3456), jnp.bfloat16),
    ((1024, 1024), jnp.float32),
    ((6144, 3456), jnp.bfloat16),
]


def _unwritten_body(shape, dtype):
    """A function whose one output, of ``shape``, is left as the allocator handed it over (the
    extension's target registered first)."""
    extension("registrations")  # fails on a GPU machine without the extension
    from jax_ub import _ext

    _ext.ensure_registered()
    return lambda: jax.ffi.ffi_call("jax_ub_test_unwritten", jax.ShapeDtypeStruct(shape, dtype))()


def _unwritten(shape, dtype):
    """:func:`_unwritten_body`, jitted afresh (it compiles after the poison, as a test's first
    call does)."""
    return jax.jit(_unwritten_body(shape, dtype))


def _id(case):
    shape, dtype = case
    return "x".join(map(str, shape)) + "-" + jnp.dtype(dtype).name


@pytest.mark.parametrize("case", SHAPES, ids=_id)
def test_poison_reaches_an_unwritten_output(case):
    shape, dtype = case
    f = _unwritten(shape, dtype)
    holes = _checks.poison(shape, dtype)
    got = f()
    out = np.asarray(got, np.float32)
    assert out.shape == shape
    n_nan = int(np.isnan(out).sum())
    (dev,) = got.devices()
    at = got.unsafe_buffer_pointer()
    assert n_nan == out.size, (
        f"{out.size - n_nan} of {out.size} elements of an unwritten output are not the poison's NaN: "
        f"the output is at {at:#x}, {'one' if at in holes[dev] else 'none'} of the poisoned blocks "
        f"({', '.join(f'{h:#x}' for h in holes[dev])}), so the GPU tiers' NaN checks would miss "
        "unwritten elements"
    )
    assert at in holes[dev]


@pytest.mark.parametrize("case", SHAPES[:3], ids=_id)
def test_the_hook_writes_nothing(case):
    """The control: with a finite fill the same output holds that value, so the NaN above came
    from the poison, not from the hook."""
    shape, dtype = case
    f = _unwritten(shape, dtype)
    _checks.poison(shape, dtype, fill=7.0)
    np.testing.assert_array_equal(np.asarray(f(), np.float32), np.full(shape, 7.0, np.float32))


def test_poison_reaches_every_device_of_a_shard_map():
    """test_overlap's form: each device's output shard, poisoned on every device of the mesh."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("tp",))
    shard = (1536, 1000)
    g = jax.jit(
        jax.shard_map(
            _unwritten_body(shard, jnp.bfloat16), mesh=mesh, in_specs=(), out_specs=P("tp"), check_vma=False
        )
    )
    holes = _checks.poison(shard, jnp.bfloat16, devs)
    out = g()
    for s in out.addressable_shards:
        data = np.asarray(s.data, np.float32)
        at = s.data.unsafe_buffer_pointer()
        assert np.isnan(data).all(), (
            f"device {s.device}: {int((~np.isnan(data)).sum())} of "
            f"{data.size} unwritten elements are not the poison's NaN "
            f"(at {at:#x}; poisoned: {[hex(h) for h in holes[s.device]]})"
        )
        assert at in holes[s.device]


@pytest.mark.parametrize("case", SHAPES, ids=_id)
def test_a_previous_right_answer_is_not_what_an_unwritten_output_reads(case):
    """The case the poison exists for: an earlier op's output of the same shape, freed, leaves a
    hole of exactly the right size holding a right answer. The poison takes it up first."""
    shape, dtype = case
    f = _unwritten(shape, dtype)
    f()  # compiled, so the poison below comes right before a call that only runs
    for _ in range(3):
        stale = jax.jit(lambda: jnp.full(shape, 3.0, dtype))()
        jax.block_until_ready(stale)
        stale.delete()
    _checks.poison(shape, dtype)
    out = np.asarray(f(), np.float32)
    assert np.isnan(out).all(), (
        f"{int((out == 3.0).sum())} of {out.size} elements read an earlier "
        "output's value, not the poison's NaN"
    )
