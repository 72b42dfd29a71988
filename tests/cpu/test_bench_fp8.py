"""CPU tier: ``python -m jax_ub.bench ag|rs --dtype fp8`` at tiny sizes (the reference path).

Checks the plumbing: jax_ub's FP8 op, XLA's FP8 (all-gather of float8 x, then ``lax.dot_general``
on float8 operands) and both bfloat16 ops built, checked against their references and timed in one
run; records, table and chart written. Not the speed.
"""

from __future__ import annotations

import importlib.util
import json

import jax.numpy as jnp
import numpy as np
import pytest

import jax_ub
from jax_ub.bench import __main__ as cli
from jax_ub.bench import agrs, harness

FAST = ["--warmup", "1", "--iters", "1", "--reps", "1"]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch):
    for name in jax_ub.config.KNOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jax_ub.config, "_active", None)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_bench_runs_every_impl_in_one_run(op, tmp_path, capsys):
    args = [op, "--dtype", "fp8", "--tp", "2", "--shapes", "64,32,64", *FAST]
    assert cli.main([*args, "--out", str(tmp_path), "--machine", "test-box"]) == 0
    out = capsys.readouterr().out
    assert "path: xla-reference" in out and "fp8 vs xla_fp8" in out and "fp8 vs jax_ub_bf16" in out
    # its own file: a bf16 run of the same op on the same day keeps its records
    (path,) = tmp_path.glob("*.json")
    assert path.name.endswith(f"-{op}-fp8.json"), path.name
    if HAVE_MPL:
        assert path.with_suffix(".png").stat().st_size > 0
    recs = json.loads(path.read_text())["records"]
    impls = {r["impl"]: r for r in recs}
    assert set(impls) == {"xla_plain", "xla_fp8", "jax_ub_bf16", "jax_ub_fp8"}
    assert all(r["ms"] > 0 and r["dtype"] == "fp8" and (r["M"], r["K"], r["N"]) == (64, 32, 64) for r in recs)
    # each checked against its reference: jax_ub FP8 against XLA's FP8 (the same float8 data),
    # jax_ub bf16 against XLA's bf16
    assert 0 <= impls["jax_ub_fp8"]["rel_err"] <= harness.REL_ERR_BOUND["fp8"]
    assert 0 <= impls["jax_ub_bf16"]["rel_err"] <= harness.REL_ERR_BOUND["bfloat16"]
    row = next(line for line in out.splitlines() if line.startswith("2   64,32,64"))
    assert row.count("x") >= 2  # the two speedups


def test_fp8_impls_compute_the_fp8_product(cpu_mesh):
    """xla_fp8 and jax_ub_fp8 both compute the dequantized product of the same float8 data,
    which is within FP8 rounding of the bfloat16 product (xla_plain)."""
    mesh = cpu_mesh(2)
    for op in ("ag", "rs"):
        impls = agrs.build_fp8(op, mesh, 32, 64, 16, cuda=False)
        outs = {}
        for name, entry in impls.items():
            fn, fargs = entry() if callable(entry) else entry
            outs[name] = np.asarray(jnp.asarray(fn(*fargs), jnp.float32), np.float64)
        x8, w8, sx, sw = impls["xla_fp8"][1]
        x, w = impls["xla_plain"][1]
        want = (np.asarray(x8, np.float64) * float(sx)) @ (np.asarray(w8, np.float64) * float(sw))
        for name in ("xla_fp8", "jax_ub_fp8"):
            err = np.linalg.norm(outs[name] - want) / np.linalg.norm(want)
            assert err < 1e-2, (op, name, err)
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        err = np.linalg.norm(outs["jax_ub_fp8"] - exact) / np.linalg.norm(exact)
        assert 1e-4 < err < 0.08, (op, err)  # FP8's rounding: visible, and bounded


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_impls_on_the_cuda_path_run_each_schedule_with_the_scales(op, cpu_mesh, monkeypatch):
    """With ``cuda=True`` there is a ``jax_ub_fp8_<method>`` per schedule of the op, and each one
    calls the op with that method and the float8 scales; ``jax_ub_bf16`` calls it without scales.
    The op runs as its pure-XLA reference here (no GPU), recording what it was asked for."""
    from jax_ub import methods

    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    real = getattr(jax_ub, name)
    calls = []

    def recorded(x, w, axis_name, *, method=None, scales=None):
        calls.append((method, scales is not None, x.dtype))
        return real(x, w, axis_name, method="xla", scales=scales)

    monkeypatch.setattr(jax_ub, name, recorded)
    impls = agrs.build_fp8(op, cpu_mesh(2), 32, 64, 16, cuda=True)
    schedules = methods.SCHEDULES[methods.AG if op == "ag" else methods.RS]
    assert list(impls) == [
        "xla_plain",
        "xla_fp8",
        "jax_ub_bf16",
        "jax_ub_fp8",
        *(f"jax_ub_fp8_{m}" for m in schedules),
    ]
    outs = {}
    for impl, (fn, fargs) in impls.items():
        calls.clear()
        outs[impl] = np.asarray(jnp.asarray(fn(*fargs), jnp.float32), np.float64)
        if impl.startswith("xla_"):
            assert calls == [], impl
        elif impl == "jax_ub_bf16":
            assert calls == [(None, False, jnp.bfloat16)], calls
        else:
            method = impl.removeprefix("jax_ub_fp8").removeprefix("_") or methods.AUTO
            assert calls == [(method, True, jnp.float8_e4m3fn)], (impl, calls)
    ref = outs["xla_fp8"]
    for impl, out in outs.items():  # every FP8 impl: the same product of the same float8 data
        if "fp8" in impl:
            assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2, impl
