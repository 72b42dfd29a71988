"""CPU tier: tuning ``method="auto"`` for a program's own shapes (jax_ub.tuning, bench tune).

Recording happens at trace time on any path, so it is checked here on the reference path: the
shapes recorded for the ops, their backward duals, the layers, the env-var file. ``bench tune``'s
plumbing runs on CPU (no CUDA methods there) and, with its timer replaced by random timings, must
write a file from which ``auto`` picks the fastest method at each recorded shape.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import choice, tuning
from jax_ub import nn as ubnn
from jax_ub.bench import __main__ as cli
from jax_ub.bench import agrs, harness, tune

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _shapes(rec: tuning.Recording) -> list[tuple]:
    return [(s["op"], s["tp"], s["dtype"], s["M"], s["K"], s["N"], s["role"], s["calls"])
            for s in rec.shapes()]


def _program(mesh, recompute=False):
    """A [b, s, h] block: AG over the sequence (axis 1), then RS back over it."""

    def body(x, w1, w2):
        h = jax_ub.all_gather_matmul(x, w1, "tp", gather_axis=1, recompute_gathered=recompute)
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", scatter_axis=1)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp", None)),
                                 out_specs=P(None, "tp")))


@pytest.mark.parametrize("tp", [2, 4])
def test_records_the_global_shapes_and_backward_duals(cpu_mesh, tp):
    b, s, h, f = 2, 16, 24, 40
    mesh = cpu_mesh(tp)
    args = (jnp.ones((b, s, h), jnp.bfloat16), jnp.ones((h, f), jnp.bfloat16), jnp.ones((f, h), jnp.bfloat16))
    assert not tuning._active
    with tuning.record() as rec:
        _program(mesh).lower(*args)
    assert not tuning._active
    tokens = b * s  # M counts the rows over every leading dim
    assert _shapes(rec) == [
        ("ag", tp, "bfloat16", tokens, h, f, "forward", 1),
        ("rs", tp, "bfloat16", tokens, f, h, "backward", 1),  # dx of the AG: RS of dy @ w1ᵀ
        ("rs", tp, "bfloat16", tokens, f, h, "forward", 1),
        ("ag", tp, "bfloat16", tokens, h, f, "backward", 1),  # dx of the RS: AG of dy, @ w2ᵀ
    ]
    # Each entry's (M, K, N) is what auto's choice computes from the call's local shards.
    assert choice.global_shape("ag", tp, (b, s // tp, h), (h, f // tp)) == (tokens, h, f)
    assert choice.global_shape("rs", tp, (b, s, f // tp), (f // tp, h)) == (tokens, f, h)


def test_recompute_gathered_records_no_dual_and_calls_are_counted(cpu_mesh):
    mesh = cpu_mesh(2)
    x, w1, w2 = jnp.ones((1, 8, 4)), jnp.ones((4, 6)), jnp.ones((6, 4))
    with tuning.record() as rec:
        _program(mesh, recompute=True).lower(x, w1, w2)
        _program(mesh, recompute=True).lower(x, w1, w2)  # a second trace of the same program
    assert _shapes(rec) == [("ag", 2, "float32", 8, 4, 6, "forward", 2),
                            ("rs", 2, "float32", 8, 6, 4, "forward", 2),
                            ("ag", 2, "float32", 8, 4, 6, "backward", 2)]


def test_nested_recordings_and_size_one_axis(cpu_mesh):
    x, w1, w2 = jnp.ones((1, 8, 4)), jnp.ones((4, 8)), jnp.ones((8, 4))
    with tuning.record() as outer:
        _program(cpu_mesh(2)).lower(x, w1, w2)
        with tuning.record() as inner:
            _program(cpu_mesh(1)).lower(x, w1, w2)  # tp=1: a plain dot, nothing to tune
            _program(cpu_mesh(4)).lower(x, w1, w2)
    assert {s["tp"] for s in inner.shapes()} == {4}
    assert {s["tp"] for s in outer.shapes()} == {2, 4}
    assert len(outer.shapes()) == 8 and outer.shapes()[4:] == inner.shapes()
    assert inner.shapes(roles=("forward",)) == [s for s in inner.shapes() if s["role"] == "forward"]


def test_layers_record_their_ops(cpu_mesh):
    H, F, B, S = 16, 32, 2, 8
    with jax.set_mesh(cpu_mesh(4)):
        mlp = ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(0))
        with tuning.record() as rec:
            nnx.jit(lambda m, x: m(x))(mlp, jnp.ones((B, S, H)))
    fwd = [s for s in _shapes(rec) if s[6] == "forward"]
    assert fwd == [("ag", 4, "float32", B * S, H, F, "forward", 1),
                   ("rs", 4, "float32", B * S, F, H, "forward", 1)]


def test_env_var_writes_the_file(tmp_path):
    path = tmp_path / "sub" / "shapes.json"
    code = (
        "import jax, jax.numpy as jnp, numpy as np, jax_ub\n"
        "from jax.sharding import Mesh, PartitionSpec as P\n"
        "mesh = Mesh(np.array(jax.devices()[:2]), ('tp',))\n"
        "f = lambda: jax.jit(jax.shard_map(lambda x, w: jax_ub.all_gather_matmul(x, w, 'tp'), mesh=mesh,\n"
        "    in_specs=(P('tp', None), P(None, 'tp')), out_specs=P(None, 'tp')))  # a new trace per call\n"
        "f()(jnp.ones((8, 4)), jnp.ones((4, 6)))\n"
        "f()(jnp.ones((16, 4)), jnp.ones((4, 6)))\n"
        "f()(jnp.ones((8, 4)), jnp.ones((4, 6)))\n"  # a shape seen before: its count in the file grows
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_UB_RECORD_SHAPES=str(path),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    entries = tuning.load(str(path))
    assert [(s.op, s.M, s.K, s.N, role, calls) for s, role, calls in entries] == [
        ("ag", 8, 4, 6, "forward", 2), ("rs", 8, 6, 4, "backward", 2),
        ("ag", 16, 4, 6, "forward", 1), ("rs", 16, 6, 4, "backward", 1)]
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("doc, match", [
    ("not json", "cannot read it as JSON"),
    ({"shapes": []}, "not a jax_ub shapes file"),
    ({"jax_ub_shapes": 2, "shapes": []}, "format version 2"),
    ({"jax_ub_shapes": 1, "shapes": {}}, "'shapes' must be a list"),
    ({"jax_ub_shapes": 1, "shapes": [{"op": "ag", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4}]},
     r"entry 0: missing 'N'"),
    ({"jax_ub_shapes": 1, "shapes": [{"op": "mm", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4, "N": 6}]},
     "op must be 'ag' or 'rs'; got 'mm'"),
    ({"jax_ub_shapes": 1, "shapes": [{"op": "rs", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 5, "N": 6}]},
     "M and K of an rs shape must be divisible by tp=2; got M=8, K=5, N=6"),
    ({"jax_ub_shapes": 1, "shapes": [{"op": "ag", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4, "N": 6,
                                      "role": "sideways"}]}, "role must be one of"),
    ({"jax_ub_shapes": 1, "shapes": [{"op": "ag", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4, "N": -6}]},
     "positive integers"),
    ({"jax_ub_shapes": 1, "shapes": [{"op": "ag", "tp": 2, "dtype": "float99", "M": 8, "K": 4, "N": 6}]},
     "unknown dtype 'float99'"),
])
def test_load_refuses_bad_files(tmp_path, doc, match):
    path = tmp_path / "s.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        tuning.load(str(path))


def _shapes_file(tmp_path: Path, tp: int = 4) -> Path:
    rec = tuning.Recording()
    for s, role in [(tuning.OpShape("ag", tp, "float32", 64, 32, 96), "forward"),
                    (tuning.OpShape("rs", tp, "float32", 64, 96, 32), "backward"),
                    (tuning.OpShape("rs", tp, "float32", 64, 96, 32), "forward"),
                    (tuning.OpShape("ag", tp, "float32", 64, 32, 96), "backward"),
                    (tuning.OpShape("ag", 16, "float32", 64, 32, 96), "forward")]:  # more than the devices
        rec.note(s, role)
    path = tmp_path / "shapes.json"
    rec.save(str(path))
    return path


def test_bench_tune_on_cpu(tmp_path):
    """The CLI end to end on 4 simulated devices (reference path): no CUDA method to measure, so no
    tuning file (JAX_UB_TUNING_FILE would refuse it); exit 2 before timing, saying why."""
    path = _shapes_file(tmp_path)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    p = subprocess.run([sys.executable, "-m", "jax_ub.bench", "tune", str(path), "--warmup", "1", "--iters",
                        "1", "--reps", "1", "--out", str(tmp_path / "out"), "--machine", "box"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 2, p.stdout + p.stderr[-3000:]
    assert "skip 1 shape(s) at tp=16: only 4 devices" in p.stderr
    assert "error: nothing to tune on this machine" in p.stderr and "no file written" in p.stderr
    assert not (tmp_path / "out").exists()

    bad = subprocess.run([sys.executable, "-m", "jax_ub.bench", "tune", str(tmp_path / "missing.json")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "cannot read it as JSON" in bad.stderr


def test_tune_with_no_shape_that_fits_fails_and_writes_nothing(tmp_path, capsys):
    """Every recorded shape at a tp above the devices here: exit 2, no (empty) tuning file."""
    rec = tuning.Recording()
    rec.note(tuning.OpShape("ag", 16, "float32", 64, 32, 96), "forward")
    path = tmp_path / "shapes.json"
    rec.save(str(path))
    assert cli.main(["tune", str(path), "--out", str(tmp_path / "o")]) == 2
    out = capsys.readouterr().err
    assert "error: no shape of" in out and "can be measured on these" in out, out
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_tune_file_makes_auto_pick_the_fastest(tmp_path, monkeypatch, capsys):
    """tune.run with the CUDA path stubbed and random timings: the file it writes is a valid
    JAX_UB_TUNING_FILE from which choice picks, at every recorded shape, the fastest method."""
    path = _shapes_file(tmp_path)
    rng = random.Random(7)
    timings: dict[tuple, dict[str, float]] = {}

    def fake_time(label, impls, a, **kw):
        # distinct by more than choice.TIE, so the fastest is unambiguous
        ms = rng.sample([1.0 * 1.1 ** i for i in range(len(impls))], len(impls))
        timings[label] = dict(zip(impls, ms, strict=True))
        return timings[label]

    monkeypatch.setattr(harness, "path_info", lambda: (True, "path: cuda"))
    monkeypatch.setattr(harness, "make_mesh", lambda tp, cuda: jax.sharding.Mesh(jax.devices("cpu")[:tp], ("tp",)))
    monkeypatch.setattr(harness, "time_impls", fake_time)
    monkeypatch.setattr(agrs, "auto_method", lambda op, *rest: choice.FALLBACK[op])
    a = cli._parser().parse_args(["tune", str(path), "--out", str(tmp_path / "o"), "--machine", "box"])
    a.date = "20261123"
    assert tune.run(a) == 0
    out = tmp_path / "o" / "box-20261123-tune.json"
    shapes = choice.load_bench_file(str(out))
    assert len(timings) == 2 and len(shapes) == 2
    for label, res in timings.items():
        assert not any(k.startswith(("gemm", "comm")) or k == "xla_windowed" for k in res)  # not --full
        methods = {k[len("jax_ub_"):]: v for k, v in res.items() if k.startswith("jax_ub_")}
        assert set(methods) == set(choice.METHODS["ag" if " ag " in f" {label} " else "rs"]) - {"xla"}
        methods["xla"] = res["xla_plain"]
        fastest = min(methods, key=methods.get)
        op, M, K, N = ("ag", 64, 32, 96) if "tune ag" in label else ("rs", 64, 96, 32)
        assert choice.choose(op, 4, "float32", M, K, N, str(out)).method == fastest
        assert tune.best(res) == (fastest, methods[fastest])
    printed = capsys.readouterr().out
    assert f"export JAX_UB_TUNING_FILE={out}" in printed
