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
import numpy as np
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
    return [
        (s["op"], s["tp"], s["dtype"], s["M"], s["K"], s["N"], s["role"], s["calls"]) for s in rec.shapes()
    ]


def _program(mesh, recompute=False):
    """A [b, s, h] block: AG over the sequence (axis 1), then RS back over it."""

    def body(x, w1, w2):
        h = jax_ub.all_gather_matmul(x, w1, "tp", gather_axis=1, recompute_gathered=recompute)
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", scatter_axis=1)

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp", None)), out_specs=P(None, "tp")
        )
    )


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
    assert _shapes(rec) == [
        ("ag", 2, "float32", 8, 4, 6, "forward", 2),
        ("rs", 2, "float32", 8, 6, 4, "forward", 2),
        ("ag", 2, "float32", 8, 4, 6, "backward", 2),
    ]


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


def test_calls_that_never_run_the_cuda_path_are_not_recorded(cpu_mesh):
    """Over a jax.vmap axis named like the TP axis, or over several mesh axes, a call runs XLA's
    collectives whatever the method: recording them gave bench tune made-up shapes to time."""
    w = jnp.ones((16, 32), jnp.bfloat16)
    two_axes = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "tp"))
    with tuning.record() as rec:
        jax.vmap(lambda a: jax_ub.all_gather_matmul(a, w, "tp"), axis_name="tp")(
            jnp.ones((4, 2, 16), jnp.bfloat16)
        )
        jax.jit(
            jax.shard_map(
                lambda x, w: jax_ub.all_gather_matmul(x, w, ("dp", "tp")),
                mesh=two_axes,
                in_specs=(P(("dp", "tp")), P()),
                out_specs=P(None, ("dp", "tp")),
            )
        )(jnp.ones((8, 16), jnp.bfloat16), w)
        _program(cpu_mesh(2)).lower(jnp.ones((1, 8, 16)), jnp.ones((16, 8)), jnp.ones((8, 16)))
    assert {s["tp"] for s in rec.shapes()} == {2} and len(rec.shapes()) == 4, rec.shapes()


def test_layers_record_their_ops(cpu_mesh):
    H, F, B, S = 16, 32, 2, 8
    with jax.set_mesh(cpu_mesh(4)):
        mlp = ubnn.ParallelMLP(H, F, rngs=nnx.Rngs(0))
        with tuning.record() as rec:
            nnx.jit(lambda m, x: m(x))(mlp, jnp.ones((B, S, H)))
    fwd = [s for s in _shapes(rec) if s[6] == "forward"]
    assert fwd == [
        ("ag", 4, "float32", B * S, H, F, "forward", 1),
        ("rs", 4, "float32", B * S, F, H, "forward", 1),
    ]


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
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_UB_RECORD_SHAPES=str(path),
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    entries = tuning.load(str(path))
    assert [(s.op, s.M, s.K, s.N, role, calls) for s, role, calls in entries] == [
        ("ag", 8, 4, 6, "forward", 2),
        ("rs", 8, 6, 4, "backward", 2),
        ("ag", 16, 4, 6, "forward", 1),
        ("rs", 16, 6, 4, "backward", 1),
    ]
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize(
    "doc, match",
    [
        ("not json", "cannot read it as JSON"),
        ({"shapes": []}, "not a jax_ub shapes file"),
        ({"jax_ub_shapes": 2, "shapes": []}, "format version 2"),
        ({"jax_ub_shapes": 1, "shapes": {}}, "'shapes' must be a list"),
        (
            {"jax_ub_shapes": 1, "shapes": [{"op": "ag", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4}]},
            r"entry 0: missing 'N'",
        ),
        (
            {
                "jax_ub_shapes": 1,
                "shapes": [{"op": "mm", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4, "N": 6}],
            },
            "op must be 'ag' or 'rs'; got 'mm'",
        ),
        (
            {
                "jax_ub_shapes": 1,
                "shapes": [{"op": "rs", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 5, "N": 6}],
            },
            "M and K of an rs shape must be divisible by tp=2; got M=8, K=5, N=6",
        ),
        (
            {
                "jax_ub_shapes": 1,
                "shapes": [
                    {"op": "ag", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4, "N": 6, "role": "sideways"}
                ],
            },
            "role must be one of",
        ),
        (
            {
                "jax_ub_shapes": 1,
                "shapes": [{"op": "ag", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4, "N": -6}],
            },
            "positive integers",
        ),
        (
            {
                "jax_ub_shapes": 1,
                "shapes": [{"op": "ag", "tp": 2, "dtype": "float99", "M": 8, "K": 4, "N": 6}],
            },
            "dtype must be one of bfloat16, float16, float32 \\(the dtypes jax_ub's ops take\\); "
            "got 'float99'",
        ),
    ],
)
def test_load_refuses_bad_files(tmp_path, doc, match):
    path = tmp_path / "s.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        tuning.load(str(path))


def _shapes_file(tmp_path: Path, tp: int = 4) -> Path:
    rec = tuning.Recording()
    for s, role in [
        (tuning.OpShape("ag", tp, "float32", 64, 32, 96), "forward"),
        (tuning.OpShape("rs", tp, "float32", 64, 96, 32), "backward"),
        (tuning.OpShape("rs", tp, "float32", 64, 96, 32), "forward"),
        (tuning.OpShape("ag", tp, "float32", 64, 32, 96), "backward"),
        (tuning.OpShape("ag", 16, "float32", 64, 32, 96), "forward"),
    ]:  # more than the devices
        rec.note(s, role)
    path = tmp_path / "shapes.json"
    rec.save(str(path))
    return path


def test_bench_tune_on_cpu(tmp_path):
    """The CLI end to end on 4 simulated devices (reference path): no CUDA method to measure, so no
    tuning file (JAX_UB_TUNING_FILE would refuse it); exit 2 before timing, saying why."""
    path = _shapes_file(tmp_path)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_ub.bench",
            "tune",
            str(path),
            "--warmup",
            "1",
            "--iters",
            "1",
            "--reps",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--machine",
            "box",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert p.returncode == 2, p.stdout + p.stderr[-3000:]
    # The missing CUDA path is the reason given, not the device count (tp=16 on 4 devices): more
    # devices would not help.
    assert "error: nothing to tune on this machine" in p.stderr and "no file written" in p.stderr
    assert "only 4 devices" not in p.stderr and "can be measured on these" not in p.stderr
    assert not (tmp_path / "out").exists()

    bad = subprocess.run(
        [sys.executable, "-m", "jax_ub.bench", "tune", str(tmp_path / "missing.json")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "cannot read it as JSON" in bad.stderr


def test_tune_with_no_shape_that_fits_fails_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """On the CUDA path (stubbed), every recorded shape at a tp above the devices here: exit 2, no
    (empty) tuning file."""
    monkeypatch.setattr(harness, "path_info", lambda: (True, "path: cuda"))
    rec = tuning.Recording()
    rec.note(tuning.OpShape("ag", 16, "float32", 64, 32, 96), "forward")
    path = tmp_path / "shapes.json"
    rec.save(str(path))
    assert cli.main(["tune", str(path), "--out", str(tmp_path / "o")]) == 2
    out = capsys.readouterr().err
    assert "skip 1 shape(s) at tp=16: only" in out
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
        ms = rng.sample([1.0 * 1.1**i for i in range(len(impls))], len(impls))
        timings[label] = dict(zip(impls, ms, strict=True))
        return timings[label]

    monkeypatch.setattr(harness, "path_info", lambda: (True, "path: cuda"))
    monkeypatch.setattr(
        harness, "make_mesh", lambda tp, cuda: jax.sharding.Mesh(jax.devices("cpu")[:tp], ("tp",))
    )
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
        methods = {k[len("jax_ub_") :]: v for k, v in res.items() if k.startswith("jax_ub_")}
        assert set(methods) == set(choice.METHODS["ag" if " ag " in f" {label} " else "rs"]) - {"xla"}
        methods["xla"] = res["xla_plain"]
        fastest = min(methods, key=methods.get)
        op, M, K, N = ("ag", 64, 32, 96) if "tune ag" in label else ("rs", 64, 96, 32)
        assert choice.choose(op, 4, "float32", M, K, N, str(out)).method == fastest
        assert tune.best(res) == (fastest, methods[fastest])
    printed = capsys.readouterr().out
    assert f"export JAX_UB_TUNING_FILE={out}" in printed


# ------------------------------------------------------------------------------------------------
# Recording: nothing recorded is said (finding 12); several processes do not replace each other's
# shapes, and the file holds only what the ops take (finding 18)


def test_env_var_with_nothing_recorded_says_so_and_writes_an_empty_file(tmp_path):
    """One device (forgot XLA_FLAGS on a CPU machine): tp=1, nothing to record. Without a word, the
    next step would fail on a missing file."""
    path = tmp_path / "shapes.json"
    code = (
        "import jax, jax.numpy as jnp, numpy as np, jax_ub\n"
        "from jax.sharding import Mesh, PartitionSpec as P\n"
        "mesh = Mesh(np.array(jax.devices()[:1]), ('tp',))\n"
        "jax.jit(jax.shard_map(lambda x, w: jax_ub.all_gather_matmul(x, w, 'tp'), mesh=mesh,\n"
        "    in_specs=(P('tp', None), P(None, 'tp')), out_specs=P(None, 'tp')))"
        ".lower(jnp.ones((8, 4)), jnp.ones((4, 6)))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_UB_RECORD_SHAPES=str(path), XLA_FLAGS="")
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert (
        f"JAX_UB_RECORD_SHAPES={str(path)!r}: no jax_ub op over a mesh axis of size > 1 was traced"
        in p.stderr
    )
    assert "--xla_force_host_platform_device_count=N" in p.stderr and f"wrote {str(path)!r}" in p.stderr
    assert tuning.load(str(path)) == []
    # A file that exists (another process's shapes, an earlier run's) is left as it was.
    path.write_text(
        '{"jax_ub_shapes": 1, "shapes": [{"op": "ag", "tp": 2, "dtype": "float32", "M": 8, "K": 4, "N": 6}]}'
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0 and "exists and is left as it was" in p.stderr, p.stderr[-2000:]
    assert len(tuning.load(str(path))) == 1


def test_each_process_of_a_multi_process_run_records_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "_launch", None)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax, "process_index", lambda: 3)
    assert tuning.env_path(str(tmp_path / "shapes.json")) == str(tmp_path / "shapes.process3.json")
    monkeypatch.setattr(tuning, "_env", None)
    with jax_ub.config.override(record_shapes=str(tmp_path / "shapes.json")):
        tuning.note_call("ag", 2, jnp.float32, (4, 4), (4, 3), backward=False)
    monkeypatch.setattr(tuning, "_env", None)
    assert [p.name for p in tmp_path.iterdir()] == ["shapes.process3.json"]
    (entry,) = tuning.load(str(tmp_path / "shapes.process3.json"))
    assert entry == (tuning.OpShape("ag", 2, "float32", 8, 4, 6), "forward", 1)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tp": 1}, r"entry 0: tp must be >= 2 \(an op over one device communicates nothing"),
        ({"dtype": "int8"}, r"entry 0: dtype must be one of bfloat16, float16, float32 .*; got 'int8'"),
        ({"dtype": "float64"}, r"entry 0: dtype must be one of bfloat16, float16, float32 .*; got 'float64'"),
    ],
)
def test_load_refuses_what_the_ops_do_not_run(tmp_path, change, match):
    path = tmp_path / "s.json"
    entry = {"op": "ag", "tp": 2, "dtype": "bfloat16", "M": 8, "K": 4, "N": 6, **change}
    path.write_text(json.dumps({"jax_ub_shapes": 1, "shapes": [entry]}))
    with pytest.raises(ValueError, match=match):
        tuning.load(str(path))


# ------------------------------------------------------------------------------------------------
# bench tune: checks before timing (findings 4, 13, 15), several shapes files, a report from the
# file as written


def _stub_cuda(monkeypatch, timings=None):
    """tune.run on CPU as if on the CUDA path; returns the labels timed."""
    timed = []

    def fake_time(label, impls, a, **kw):
        timed.append(label)
        if timings is not None:
            return {k: v for k, v in timings(label).items() if k in impls}
        return {k: 1.0 + 0.1 * i for i, k in enumerate(impls)}

    monkeypatch.setattr(harness, "path_info", lambda: (True, "path: cuda"))
    monkeypatch.setattr(
        harness, "make_mesh", lambda tp, cuda: jax.sharding.Mesh(jax.devices("cpu")[:tp], ("tp",))
    )
    monkeypatch.setattr(harness, "time_impls", fake_time)
    return timed


def _tune(tmp_path, *args):
    a = cli._parser().parse_args(["tune", *args, "--out", str(tmp_path / "o"), "--machine", "box"])
    a.date = "20261123"
    return tune.run(a), tmp_path / "o" / "box-20261123-tune.json"


def test_tune_takes_no_dtype():
    """Each shape is measured in its recorded dtype: a --dtype would be ignored."""
    with pytest.raises(SystemExit) as e:
        cli._parser().parse_args(["tune", "shapes.json", "--dtype", "float32"])
    assert e.value.code == 2


def test_tune_keeps_an_earlier_tuning_file_unless_forced(tmp_path, monkeypatch, capsys):
    timed = _stub_cuda(monkeypatch)
    shapes = _shapes_file(tmp_path)
    rc, out = _tune(tmp_path, str(shapes))
    assert rc == 0 and out.exists() and len(timed) == 2
    before = out.read_text()
    capsys.readouterr()
    rc, _ = _tune(tmp_path, str(shapes))
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {str(out)!r} exists" in err and "--force replaces it" in err, err
    assert len(timed) == 2 and out.read_text() == before  # nothing timed, nothing written
    rc, _ = _tune(tmp_path, str(shapes), "--force")
    assert rc == 0 and len(timed) == 4
    assert [p.name for p in out.parent.iterdir() if p.suffix == ".json"] == [out.name]  # no temporary left


def test_tune_reports_what_auto_chooses_from_the_file_as_written(tmp_path, monkeypatch, capsys):
    """JAX_UB_TUNING_FILE names the file this run replaces (read for "auto before"): "auto with
    this file" is chosen from the new content."""
    shapes = _shapes_file(tmp_path)
    fastest = iter(["jax_ub_push", "jax_ub_ring", "jax_ub_all_peer", "jax_ub_push"])
    wanted = {}

    def timings(label):
        if "tune ag" not in label:
            return {"xla_plain": 2.0, "jax_ub": 2.0, "jax_ub_ring": 1.0, "jax_ub_pipeline": 1.5}
        wanted[label] = next(fastest)
        return {
            k: (0.5 if k == wanted[label] else 1.0)
            for k in ("xla_plain", "jax_ub", "jax_ub_push", "jax_ub_ring", "jax_ub_all_peer")
        }

    _stub_cuda(monkeypatch, timings)
    rc, out = _tune(tmp_path, str(shapes))
    assert rc == 0
    with jax_ub.config.override(tuning_file=str(out)):
        # The tables of the first file are read before the second run writes.
        assert choice.choose("ag", 4, "float32", 64, 32, 96, str(out)).method == "push"
        capsys.readouterr()
        rc, _ = _tune(tmp_path, str(shapes), "--force")
    assert rc == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ag  4"))
    assert row.endswith("  ring"), row


def test_tune_with_an_unusable_tuning_file_stops_before_timing(tmp_path, monkeypatch, capsys):
    timed = _stub_cuda(monkeypatch)
    bad = tmp_path / "bad.json"
    bad.write_text('{"records": []}')
    with jax_ub.config.override(tuning_file=str(bad)):
        rc, out = _tune(tmp_path, str(_shapes_file(tmp_path)))
    err = capsys.readouterr().err
    assert rc == 2 and not timed and not out.exists(), err
    assert f"error: JAX_UB_TUNING_FILE {str(bad)!r} has no ag_gemm/gemm_rs records" in err, err
    assert "fix that file or unset JAX_UB_TUNING_FILE; nothing measured" in err, err


def test_tune_with_an_invalid_configuration_stops_before_timing(tmp_path, monkeypatch, capsys):
    timed = _stub_cuda(monkeypatch)
    monkeypatch.setattr(jax_ub.config, "_active", None)
    monkeypatch.setenv("JAX_UB_METHOD", "rign")
    rc, out = _tune(tmp_path, str(_shapes_file(tmp_path)))
    err = capsys.readouterr().err
    assert rc == 2 and not timed and not out.exists(), err
    assert "error: invalid jax_ub configuration: JAX_UB_METHOD must be one of" in err, err


def test_tune_measures_the_shapes_of_several_files_once(tmp_path, monkeypatch):
    """One file per process: the same shape in two files is measured once, at the most calls one
    file counted (every process of an SPMD program traces the same calls)."""
    timed = _stub_cuda(monkeypatch)
    files = []
    for i, extra in enumerate((None, tuning.OpShape("rs", 4, "float32", 128, 96, 32))):
        rec = tuning.Recording()
        rec.note(tuning.OpShape("ag", 4, "float32", 64, 32, 96), "forward")
        if extra is not None:
            rec.note(extra, "forward")
        files.append(tmp_path / f"shapes.process{i}.json")
        rec.save(str(files[-1]))
    rc, out = _tune(tmp_path, *map(str, files))
    assert rc == 0
    assert sorted(timed) == [
        "tune ag tp4 float32 64x32x96 (forward, 1 calls)",
        "tune rs tp4 float32 128x96x32 (forward, 1 calls)",
    ]
    assert json.loads(out.read_text())["shapes_files"] == [str(f) for f in files]


def test_tune_marks_where_auto_does_not_run_the_fastest_chain(tmp_path, monkeypatch, capsys):
    """bfloat16 at tp=4: chain measured fastest, but its partial sums travel in bfloat16."""
    rec = tuning.Recording()
    rec.note(tuning.OpShape("rs", 4, "bfloat16", 64, 96, 32), "forward")
    rec.save(str(tmp_path / "bf16.json"))
    _stub_cuda(
        monkeypatch,
        lambda label: {
            "xla_plain": 3.0,
            "jax_ub": 2.0,
            "jax_ub_ring": 1.0,
            "jax_ub_pipeline": 1.5,
            "jax_ub_chain": 0.5,
            "jax_ub_columns": 2.0,
        },
    )
    rc, out = _tune(tmp_path, str(tmp_path / "bf16.json"))
    assert rc == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("rs  4"))
    assert "chain 0.500" in row and row.endswith("  ring*"), row
    assert "*: chain measured fastest there, but sums the partials in the op's dtype at tp >= 3" in printed
    assert choice.choose("rs", 4, "bfloat16", 64, 96, 32, str(out)).method == "ring"


def test_a_process_that_shut_jax_distributed_down_still_names_its_own_file(tmp_path):
    """Two real jax.distributed processes record nothing and call jax.distributed.shutdown()
    before exit: each still writes (and names) its own empty shapes.process<i>.json, not a
    shared shapes.json they would race on."""
    try:
        from tests.launcher import format_failures, parallel_launch
    except ImportError:  # tests/ is not a package: import launcher.py from its folder
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from launcher import format_failures, parallel_launch

    name = f"shapes-{random.Random().randrange(1 << 30):x}.json"
    path = tmp_path / name
    worker = Path(__file__).resolve().with_name("_init_worker.py")
    res = parallel_launch(
        2,
        worker,
        ["record_then_shutdown"],
        timeout_s=120,
        env={"JAX_PLATFORMS": "cpu", "JAX_UB_RECORD_SHAPES": str(path)},
    )
    assert all(r.returncode == 0 and not r.timed_out for r in res), format_failures(res)
    stem = name.removesuffix(".json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.process0.json", f"{stem}.process1.json"]
    for r in res:
        own = tmp_path / f"{stem}.process{r.rank}.json"
        assert f"wrote {str(own)!r} without shapes" in r.stderr, r.stderr[-2000:]
        assert tuning.load(str(own)) == []


def test_a_missing_shapes_file_names_the_per_process_files(tmp_path):
    """Under launch.sh, JAX_UB_RECORD_SHAPES=shapes.json wrote shapes.process<i>.json: tune given
    shapes.json (as the one-process steps say) names them instead of only "No such file"."""
    for i in range(2):
        (tmp_path / f"shapes.process{i}.json").write_text("{}")
    with pytest.raises(ValueError) as info:
        tuning.load(str(tmp_path / "shapes.json"))
    msg = str(info.value)
    assert "No such file" in msg and "a run of several processes writes one file each: " in msg, msg
    assert f"{tmp_path}/shapes.process0.json, {tmp_path}/shapes.process1.json; give them all" in msg, msg
    with pytest.raises(ValueError) as info:  # nothing of the kind there: no hint
        tuning.load(str(tmp_path / "other.json"))
    assert "several processes" not in str(info.value)
