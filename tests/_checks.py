"""Result checks shared by the GPU tiers: every device's buffer, every element.

Two ways a check can look right and see little:
- ``np.asarray`` of an output with a replicated out_spec reads device 0's buffer only (under
  ``check_vma=False`` shard_map takes the copies to be equal); a rank that wrote its copy wrong is
  never read. These helpers walk ``addressable_shards``: each device's buffer against the part of
  the expected array it holds.
- one relative Frobenius error over a whole tensor leaves room for hundreds of wrong elements (a
  row piece from a wrong peer, a stale partial sum). Here each element gets its own bound, from
  the rounding analysis of a dot product: ``|out - ref| <= (r * eps(dtype) + 2 * k * eps(f32)) *
  (|x| @ |w|)``, where ``r`` counts the roundings to the output dtype on the way (1 for a GEMM,
  one per hop where partial sums travel in the op's dtype) and ``k * eps(f32)`` covers float32
  accumulation of ``k`` products on either side. An element computed from the wrong operands is
  off by about ``|ref|``, far above that bound for all but the smallest elements.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_EPS32 = float(np.finfo(np.float32).eps)
_TINY = float(np.finfo(np.float32).tiny)


def _eps(dtype) -> float:
    import jax.numpy as jnp

    return float(jnp.finfo(dtype).eps)


@dataclasses.dataclass(frozen=True)
class Expected:
    """The exact value (float64) and each element's allowed absolute error."""

    value: np.ndarray
    bound: np.ndarray


def matmul_expected(x, w, dtype=None, roundings: int = 1) -> Expected:
    """x @ w (global arrays, any leading dims on x) and its element-wise bound for an output of
    ``dtype`` (default x's). For host (numpy) arrays a float64 product; otherwise XLA's float32
    dot at HIGHEST precision, wherever x and w live (not jax_ub's GEMM), whose own error is within
    the ``k * eps(f32)`` share of the bound."""
    dtype = x.dtype if dtype is None else dtype
    if isinstance(x, np.ndarray) and isinstance(w, np.ndarray):  # host arrays: float64 here
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        return Expected(
            x64 @ w64,
            (roundings * _eps(dtype) + 2 * x.shape[-1] * _EPS32) * (np.abs(x64) @ np.abs(w64)) + _TINY,
        )
    import jax
    import jax.numpy as jnp

    hp = jax.lax.Precision.HIGHEST
    x32, w32 = jnp.asarray(x).astype(jnp.float32), jnp.asarray(w).astype(jnp.float32)
    value = np.asarray(jnp.matmul(x32, w32, precision=hp), np.float64)
    scale = np.asarray(jnp.matmul(jnp.abs(x32), jnp.abs(w32), precision=hp), np.float64)
    return Expected(value, (roundings * _eps(dtype) + 2 * x32.shape[-1] * _EPS32) * scale + _TINY)


def sum_expected(parts, dtype=None, roundings: int = 1) -> Expected:
    """The sum over axis 0 of ``parts`` (one slice per rank) and its element-wise bound."""
    p64 = np.asarray(parts, np.float64)
    dtype = parts.dtype if dtype is None else dtype
    return Expected(
        p64.sum(axis=0), (roundings * _eps(dtype) + 2 * len(p64) * _EPS32) * np.abs(p64).sum(axis=0) + _TINY
    )


# The poison's spacers (see poison): kept alive until the next call, so the freed NaN blocks stay
# holes of exactly an output's size while the op that follows allocates.
_held: list = []


def poison(shape, dtype, devices=None, copies: int = 4, fill: float = float("nan")) -> dict:
    """Leave ``copies`` freed blocks full of NaN (``fill``), each of exactly an output's size, on
    each device, so that an element the next op leaves unwritten reads NaN, not a right answer
    left over from an earlier op. Call it right before the op. ``devices``: default the default
    device. Returns ``{device: [address of each freed block]}``.

    XLA's allocator (best fit) gives a new buffer the smallest free block it fits in. Freed one
    after another, adjacent NaN buffers merge into one larger block (and with free space beside
    them), and another hole of the right size wins: the output then lands in old memory. So the
    buffers go in pairs, allocated from the host (no program, no constants of its own): the first
    of each pair is freed, the second (a spacer) is held until the next call, which keeps every
    freed block apart and exactly the output's size. The first allocations also take up any older
    hole of that size (a previous op's output, with its right answer). tests/gpu/test_poison.py
    shows, with a custom call that writes nothing, that the output lands in one of these blocks."""
    import jax

    global _held
    _held = []  # the previous call's spacers: free them before allocating anew
    devices = [jax.devices()[0]] if devices is None else list(devices)
    host = np.full(shape, fill, np.dtype(dtype))
    pairs = [(jax.device_put(host, d), jax.device_put(host, d)) for d in devices for _ in range(copies)]
    jax.block_until_ready(pairs)
    holes: dict = {}
    for free, spacer in pairs:
        (dev,) = free.devices()
        holes.setdefault(dev, []).append(free.unsafe_buffer_pointer())
        free.delete()
        _held.append(spacer)
    return holes


def _buffers(out):
    """(device, the buffer's data, the index of the global array it holds) of every device's
    buffer of ``out``; a host array is one buffer holding everything."""
    shards = getattr(out, "addressable_shards", None)
    if not shards:
        return [("host", np.asarray(out), ...)]
    return [(str(s.device), np.asarray(s.data), s.index) for s in shards]


def assert_close(out, want: Expected, what: str = "output") -> None:
    """Every element of every device's buffer of ``out`` within its bound of ``want``, none NaN
    (the poison of an unwritten element); the message names the device, the worst element and
    how many are off."""
    assert tuple(out.shape) == want.value.shape, (what, out.shape, want.value.shape)
    for dev, got, index in _buffers(out):
        got = got.astype(np.float64)
        value, bound = want.value[index], want.bound[index]
        nan = np.isnan(got)
        if nan.any():
            first = tuple(int(v) for v in np.unravel_index(np.argmax(nan), got.shape))
            raise AssertionError(
                f"{what} on {dev}: {int(nan.sum())} of {got.size} elements NaN "
                f"(unwritten: the poison), the first at {first} of this buffer"
            )
        excess = np.abs(got - value) - bound
        if (excess > 0).any():
            i = tuple(int(v) for v in np.unravel_index(np.argmax(excess), got.shape))
            raise AssertionError(
                f"{what} on {dev}: {int((excess > 0).sum())} of {got.size} elements beyond their "
                f"bound; the worst at {i} of this buffer: got {got[i]:.6g}, expected {value[i]:.6g} "
                f"(allowed error {bound[i]:.3g})"
            )


def assert_equal(out, want, what: str = "output") -> None:
    """Every device's buffer of ``out`` equal to its part of ``want``, bit for bit (a collective
    that only moves data, such as an all-gather)."""
    want = np.asarray(want)
    assert tuple(out.shape) == want.shape, (what, out.shape, want.shape)
    for dev, got, index in _buffers(out):
        np.testing.assert_array_equal(got, want[index], err_msg=f"{what} on {dev}")
