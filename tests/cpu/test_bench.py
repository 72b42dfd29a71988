"""CPU tier: the benchmark harness ``python -m jax_ub.bench ag|rs|mlp|bulk`` at tiny sizes.

Off GPU everything runs on jax_ub's pure-XLA reference path; these tests check the plumbing (impls
built and timed, JSON records, charts, the timeline drawing), not the speed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ub
from jax_ub import trace
from jax_ub.bench import __main__ as cli
from jax_ub.bench import agrs, harness, timeline
from jax_ub.bench import mlp as mlp_bench

REPO = Path(__file__).resolve().parents[2]
FAST = ["--warmup", "1", "--iters", "1", "--reps", "1"]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=4"])
    for name in jax_ub.config.KNOB_VARIABLES:  # the bench's defaults, whatever the caller set
        env.pop(name, None)
    return env


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch):
    """Every test here starts from jax_ub's default settings: the records name the settings away
    from their defaults, and a JAX_UB_* variable of the caller's (the GPU machines' scripts set
    JAX_UB_TIMEOUT) showed up there and failed two tests."""
    for name in jax_ub.config.KNOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jax_ub.config, "_active", None)  # read again, from the cleaned environment


def _bench(args: list[str], out: Path, tag: str | None = None) -> tuple[dict, str]:
    """Runs the harness in a subprocess on 4 simulated CPU devices; (the JSON, stdout)."""
    proc = subprocess.run(
        [sys.executable, "-m", "jax_ub.bench", *args, *FAST, "--out", str(out), "--machine", "test-box"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    (path,) = out.glob(f"test-box-*-{tag or args[0]}.json")
    if HAVE_MPL:
        assert path.with_suffix(".png").stat().st_size > 0
    return json.loads(path.read_text()), proc.stdout


def _by(records: list[dict], key: str) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(r[key], []).append(r)
    return out


def _synthetic_records() -> list[dict]:
    recs = []
    for dev in range(2):
        t = 0.0
        for chunk in range(4):
            peer = (dev + chunk) % 4
            recs.append(
                {
                    "device": dev,
                    "rank": dev,
                    "op": "all_gather_matmul",
                    "epoch": 1,
                    "name": "copy" if chunk else "local_copy",
                    "chunk": peer,
                    "stream": f"comm{chunk % 2}",
                    "start_ms": t,
                    "end_ms": t + 0.2,
                }
            )
            recs.append(
                {
                    "device": dev,
                    "rank": dev,
                    "op": "all_gather_matmul",
                    "epoch": 1,
                    "name": "gemm",
                    "chunk": peer,
                    "stream": "compute0",
                    "start_ms": t + 0.2,
                    "end_ms": t + 0.5,
                }
            )
            t += 0.25
        recs.append(
            {
                "device": dev,
                "rank": dev,
                "op": "all_gather_matmul",
                "epoch": 1,
                "name": "wait",
                "chunk": -1,
                "stream": "compute0",
                "start_ms": 0.0,
                "end_ms": 0.2,
            }
        )
    return recs


# ------------------------------------------------------------------------------------------------
# timeline


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_timeline_draw_writes_png(tmp_path):
    path = tmp_path / "tl.png"
    assert timeline.draw(_synthetic_records(), str(path), "synthetic") == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_timeline_lanes_and_summary():
    recs = _synthetic_records()
    assert timeline.lanes(recs) == [
        (0, "comm0"),
        (0, "comm1"),
        (0, "compute0"),
        (1, "comm0"),
        (1, "comm1"),
        (1, "compute0"),
    ]
    text = timeline.summary(recs)
    assert "device 0: span 1.250 ms" in text and "device 1" in text
    assert timeline.draw([], "unused.png", "empty") is None


def test_capture_timeline_with_tracing(monkeypatch):
    calls = []
    fake = [{"device": 0, "name": "gemm"}]
    monkeypatch.setattr(trace, "trace_enable", calls.append, raising=False)
    monkeypatch.setattr(trace, "trace_collect", lambda: fake, raising=False)
    records, why = harness.capture_timeline(lambda x: x + 1, (jnp.ones(3),))
    assert records == fake and why == ""
    assert calls == [True, False]


def test_capture_timeline_keeps_the_last_of_back_to_back_calls(monkeypatch):
    """The picture shows a steady-state call: several calls run back to back under tracing and
    only the last one's ops (per device, the latest epochs, as many as one call runs) are kept."""
    ran = []
    # two ops per call on each device, 4 calls: epochs 1..8 (device 0) and 11..18 (device 1)
    fake = [
        {"device": d, "epoch": base + e, "name": "gemm"} for d, base in ((0, 0), (1, 10)) for e in range(1, 9)
    ]
    monkeypatch.setattr(trace, "trace_enable", lambda on: None, raising=False)
    monkeypatch.setattr(trace, "trace_collect", lambda: fake, raising=False)
    records, why = harness.capture_timeline(lambda x: ran.append(1) or x, (jnp.ones(3),), calls=4)
    assert why == "" and len(ran) == 4
    assert sorted((r["device"], r["epoch"]) for r in records) == [(0, 7), (0, 8), (1, 17), (1, 18)]
    # a count that does not divide evenly: only the latest epoch per device
    assert [r["epoch"] for r in harness.last_call(fake[:7], 4)] == [7]
    assert harness.last_call([{"device": 0, "name": "x"}], 4) == [{"device": 0, "name": "x"}]


def test_capture_timeline_without_tracing(monkeypatch):
    def broken(on):
        raise RuntimeError("extension built without tracing")

    monkeypatch.setattr(trace, "trace_enable", broken, raising=False)
    monkeypatch.setattr(trace, "trace_collect", lambda: [], raising=False)
    records, why = harness.capture_timeline(lambda x: x, (jnp.ones(3),))
    assert records is None and "without tracing" in why


def test_traced_case_without_a_jax_ub_op_says_so_and_lets_later_cases_trace(monkeypatch, tmp_path, capsys):
    """At tp=1 (or where auto runs XLA's path) the traced calls run no jax_ub op: no picture, a
    line saying why, and ``{}`` (not None, which stops the tracing of every later case)."""
    import argparse

    monkeypatch.setattr(trace, "trace_enable", lambda on: None, raising=False)
    monkeypatch.setattr(trace, "trace_collect", lambda: [], raising=False)
    a = argparse.Namespace(dtype="bfloat16")
    stem = str(tmp_path / "box")
    item = harness.traced_case(a, stem, {"M": 8, "K": 4, "N": 8, "tp": 1}, (lambda x: x, (jnp.ones(3),)))
    assert item == {}
    assert "timeline tp1-8x4x8: no records: the traced calls ran no jax_ub CUDA op" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(trace, "trace_enable", _broken)  # tracing unavailable: callers stop trying
    assert (
        harness.traced_case(a, stem, {"M": 8, "K": 4, "N": 8, "tp": 1}, (lambda x: x, (jnp.ones(3),))) is None
    )


# ------------------------------------------------------------------------------------------------
# ag / rs (in this process: 8 simulated devices)


@pytest.mark.parametrize(("op", "tps"), [("ag", ["4", "2"]), ("rs", ["4"])])
def test_ag_rs_harness(op, tps, tmp_path, capsys):
    rc = cli.main(
        [
            op,
            "--tp",
            *tps,
            "--shapes",
            "64,32,64",
            "--timeline",
            *FAST,
            "--out",
            str(tmp_path),
            "--machine",
            "test-box",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "path: xla-reference" in out and "T/T_ideal" in out
    (path,) = tmp_path.glob(f"test-box-*-{op}.json")
    doc = json.loads(path.read_text())
    assert {"machine", "date", "jax", "records"} <= set(doc) and "timelines" not in doc
    by_tp = _by(doc["records"], "tp")
    assert set(by_tp) == {int(t) for t in tps}
    for recs in by_tp.values():
        impls = {r["impl"]: r for r in recs}
        assert {"gemm_alone", "gemm_all_gpus", "comm_nccl", "xla_plain", "jax_ub"} <= set(impls)
        assert all(r["ms"] > 0 and r["op"] == ("ag_gemm" if op == "ag" else "gemm_rs") for r in recs)
        assert all((r["M"], r["K"], r["N"], r["dtype"]) == (64, 32, 64, "bfloat16") for r in recs)
        assert impls["jax_ub"]["method"] == "xla"  # what auto ran: the reference, on CPU
        assert all(r["gemm_tune"] == jax_ub.config.get().gemm_tune for r in recs)  # which plans


@pytest.mark.parametrize(
    ("op", "args"),
    [("ag", ["--tp", "16"]), ("rs", ["--tp", "4", "--shapes", "66,32,64"]), ("bulk", ["--tp", "16"])],
)
def test_a_run_with_nothing_to_measure_fails_and_writes_nothing(op, args, tmp_path, capsys):
    """Every tp larger than the devices here (8), or no shape that tp divides: exit 2, no JSON."""
    assert cli.main([op, *args, *FAST, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: nothing to measure with --tp" in err and "on 8 device(s)" in err, err
    # Off the CUDA path with too few devices, the error says how a CPU trial gets more.
    assert ("XLA_FLAGS=--xla_force_host_platform_device_count=4 gives a CPU trial 4 devices" in err) == (
        op != "rs"
    ), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("op", ["ag", "rs", "bulk"])
def test_default_shapes_off_the_cuda_path_are_announced_as_gpu_sized(op, monkeypatch, capsys, tmp_path):
    """A CPU trial without --shapes would start 8192x8192x28672 silently; the harness says first
    that the defaults are GPU-sized and how to try small ones (and says nothing with --shapes)."""
    started = []

    def stop(*args, **kw):  # the first case's mesh: stop there, nothing is timed
        started.append(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "make_mesh", stop)
    for shapes in ([], ["--shapes", "64,32,64"]):
        with pytest.raises(KeyboardInterrupt):
            cli.main([op, "--tp", "2", *FAST, *shapes, "--out", str(tmp_path)])
        err = capsys.readouterr().err
        note = (
            "note: the default shapes are sized for GPUs (up to 16384x12288x12288); on the XLA "
            "reference path each may take minutes: --shapes 512,256,768 tries the harness quickly"
        )
        assert (note in err) == (not shapes), err
    assert len(started) == 2


def test_same_program_spread_compares_auto_with_its_own_method():
    """The noise line: jax_ub against jax_ub_<the method auto ran> per shape, or against
    xla_plain where auto ran XLA's path; a shape whose twin the run did not time gives nothing."""
    rows = [
        (4, 1, 2, 3, {"jax_ub": 1.10, "jax_ub_ring": 1.00, "jax_ub_push": 2.0}, "ring"),
        (4, 1, 2, 3, {"jax_ub": 0.90, "jax_ub_push": 1.00}, "push"),
        (4, 1, 2, 3, {"jax_ub": 0.90, "xla_plain": 0.95}, "xla"),
        (4, 1, 2, 3, {"jax_ub": 0.90}, "chain"),
    ]
    assert agrs.same_program_spread(rows) == pytest.approx([0.10, 0.10, 0.05 / 0.95])


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gemm_all_gpus_is_each_gpus_local_gemm(op, cpu_mesh):
    """gemm_all_gpus: every device computes the op's whole local GEMM (AG: gathered x @ its w
    shard; RS: its x shard @ its w shard), with no communication."""
    mesh = cpu_mesh(4)
    entry = agrs.build(op, mesh, 32, 16, 24, "float32", cuda=False)["gemm_all_gpus"]
    fn, (x, w) = entry() if callable(entry) else entry  # a thunk where it allocates arrays of its own
    out = np.asarray(fn(x, w))
    xs, ws = np.asarray(x), np.asarray(w)
    for i in range(4):
        if op == "ag":
            want = xs @ ws[:, i * 6 : (i + 1) * 6]
        else:
            want = xs[:, i * 4 : (i + 1) * 4] @ ws[i * 4 : (i + 1) * 4]
        np.testing.assert_allclose(out[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("op", "tp"), [("ag", 2), ("ag", 4), ("rs", 2)])
def test_jax_ub_impls_on_the_cuda_path_run_each_schedule(op, tp, cpu_mesh, monkeypatch):
    """With ``cuda=True`` the op is timed once per schedule (``jax_ub_<method>``; push_merge only
    from PUSH_MERGE_MIN_TP, below it is push's program) after ``jax_ub`` (auto), and each one calls
    the op with that method. The op runs as its pure-XLA reference here (no GPU), recording what
    it was asked for; each output is XLA's (``xla_plain``)."""
    from jax_ub import methods

    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    real = getattr(jax_ub, name)
    calls = []

    def recorded(x, w, axis_name, *, method=None):
        calls.append(method)
        return real(x, w, axis_name, method="xla")

    monkeypatch.setattr(jax_ub, name, recorded)
    impls = agrs.build(op, cpu_mesh(tp), 32, 16, 24, "float32", cuda=True)
    schedules = [
        m
        for m in methods.SCHEDULES[methods.AG if op == "ag" else methods.RS]
        if m != methods.PUSH_MERGE or tp >= methods.PUSH_MERGE_MIN_TP
    ]
    assert (methods.PUSH_MERGE in schedules) == (op == "ag" and tp >= methods.PUSH_MERGE_MIN_TP)
    ours = [i for i in impls if i == "jax_ub" or i.startswith("jax_ub_")]
    assert ours == ["jax_ub", *(f"jax_ub_{m}" for m in schedules)]
    assert list(impls).index("xla_plain") < list(impls).index("jax_ub")  # its reference first
    fn, args = impls["xla_plain"]
    want = np.asarray(fn(*args))
    for impl in ours:
        calls.clear()
        fn, args = impls[impl]
        np.testing.assert_allclose(np.asarray(fn(*args)), want, rtol=1e-5, atol=1e-5)
        assert calls == [impl.removeprefix("jax_ub").removeprefix("_") or methods.AUTO], (impl, calls)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gemm_chunks_are_each_gpus_row_chunk_gemms(op, cpu_mesh):
    """gemm_chunks: every device computes its local GEMM as tp row-chunk GEMMs (AG: each rank's
    chunk of the gathered x @ its w shard; RS: each owner's rows of its x shard @ its w shard),
    one output per chunk, with no communication."""
    mesh = cpu_mesh(4)
    fn, (*chunks, w) = agrs.build(op, mesh, 32, 16, 24, "float32", cuda=False)["gemm_chunks"]()
    assert len(chunks) == 4
    outs = [np.asarray(o) for o in fn(*chunks, w)]
    xs = np.concatenate([np.asarray(c) for c in chunks])  # the global x, rows in order
    ws = np.asarray(w)
    for i in range(4):  # device i
        want = (
            xs @ ws[:, i * 6 : (i + 1) * 6]
            if op == "ag"
            else xs[:, i * 4 : (i + 1) * 4] @ ws[i * 4 : (i + 1) * 4]
        )
        for j in range(4):  # its chunk j
            assert outs[j].shape == (4, 8, 6 if op == "ag" else 24)
            np.testing.assert_allclose(outs[j][i], want[j * 8 : (j + 1) * 8], rtol=1e-5, atol=1e-5)


def test_ag_timeline_plumbing(tmp_path, capsys, monkeypatch):
    """--timeline as on the CUDA path, with the trace functions faked: PNG + JSON "timelines"."""
    from jax.sharding import Mesh

    monkeypatch.setattr(harness, "path_info", lambda: (True, "path: cuda"))
    monkeypatch.setattr(harness, "make_mesh", lambda tp, cuda: Mesh(np.array(jax.devices()[:tp]), ("tp",)))
    monkeypatch.setattr(trace, "trace_enable", lambda on: None, raising=False)
    monkeypatch.setattr(trace, "trace_collect", _synthetic_records, raising=False)
    rc = cli.main(
        [
            "ag",
            "--tp",
            "4",
            "--shapes",
            "64,32,64",
            "--timeline",
            *FAST,
            "--out",
            str(tmp_path),
            "--machine",
            "test-box",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "timeline tp4-64x32x64: 18 records" in out and "device 1: span" in out
    (path,) = tmp_path.glob("test-box-*-ag.json")
    doc = json.loads(path.read_text())
    (tl,) = doc["timelines"]
    assert {k: tl[k] for k in ("M", "K", "N", "tp", "dtype", "impl")} == {
        "M": 64,
        "K": 32,
        "N": 64,
        "tp": 4,
        "dtype": "bfloat16",
        "impl": "jax_ub",
    }
    assert tl["records"] == _synthetic_records()
    if HAVE_MPL:
        (png,) = tmp_path.glob("test-box-*-ag-timeline-tp4-64x32x64.png")
        assert png.stat().st_size > 0


# ------------------------------------------------------------------------------------------------
# mlp


def test_mlp_cli(tmp_path):
    doc, stdout = _bench(["mlp", "--hidden", "64", "--ffn", "128", "--tokens", "64", "--tp", "4"], tmp_path)
    assert "path: xla-reference" in stdout and "speedup vs xla_plain" in stdout
    assert doc["path"] == "xla-reference"
    # The three configurations compute the same step: (loss, |dx|) printed per impl agree.
    checks = re.findall(r"^(\w+) check \(loss, \|dx\|\): (.*)$", stdout, re.M)
    assert [m for m, _ in checks] == ["mlp", "attn_proj", "swiglu"]
    for model, line in checks:
        vals = {
            k: (float(a), float(b)) for k, a, b in re.findall(r"(\w+) \(([-\d.e+]+), ([-\d.e+]+)\)", line)
        }
        assert {"jax_ub", "xla_plain"} <= set(vals), line
        for name, (loss, dx) in vals.items():
            assert loss > 0 and dx > 0, (model, name)
            if name == "no_comm":  # the floor: the same GEMMs, not the same function
                continue
            np.testing.assert_allclose([loss, dx], vals["xla_plain"], rtol=2e-2, err_msg=f"{model} {name}")
    by_op = _by(doc["records"], "op")
    assert set(by_op) == {"mlp", "attn_proj", "swiglu"}
    for op, recs in by_op.items():
        impls = {r["impl"] for r in recs}
        assert (
            {"jax_ub", "xla_plain", "no_comm"} <= impls <= {"jax_ub", "xla_plain", "xla_windowed", "no_comm"}
        )
        for r in recs:
            assert r["ms"] > 0
            assert (r["hidden"], r["tokens"], r["tp"], r["dtype"]) == (64, 64, 4, "bfloat16")
            assert r["ffn"] == (192 if op == "attn_proj" else 128)
    assert cli.MLP_MODELS == mlp_bench.MODELS


def test_mlp_cli_remat(tmp_path):
    """--remat dots: every impl's forward under jax.checkpoint; jax_ub with
    jax_ub.checkpoint_policy(dots), jax_ub_base_policy with the bare policy; the same step."""
    doc, stdout = _bench(
        [
            "mlp",
            "--hidden",
            "64",
            "--ffn",
            "128",
            "--tokens",
            "64",
            "--tp",
            "4",
            "--remat",
            "dots",
            "--models",
            "mlp",
        ],
        tmp_path,
        tag="mlp-remat-dots",
    )
    assert re.search(
        r"^mlp: remat dots: jax_ub with jax_ub.checkpoint_policy [\d.]+ ms, with the bare "
        r"policy [\d.]+ ms",
        stdout,
        re.M,
    ), stdout
    (line,) = re.findall(r"^mlp check \(loss, \|dx\|\): (.*)$", stdout, re.M)
    vals = {k: (float(a), float(b)) for k, a, b in re.findall(r"(\w+) \(([-\d.e+]+), ([-\d.e+]+)\)", line)}
    np.testing.assert_allclose(vals["jax_ub_base_policy"], vals["xla_plain"], rtol=2e-2)
    np.testing.assert_allclose(vals["jax_ub"], vals["xla_plain"], rtol=2e-2)
    assert {r["impl"] for r in doc["records"]} >= {"jax_ub", "jax_ub_base_policy", "xla_plain"}
    assert {r.get("remat") for r in doc["records"]} == {"dots"}


def test_mlp_cli_rejects_bad_sizes(capsys):
    assert cli.main(["mlp", "--tp", "4", "--tokens", "66", "--hidden", "64", "--ffn", "128"]) == 2
    assert "--tokens (66) must be divisible" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# bulk

needs_bulk = pytest.mark.skipif(
    not hasattr(jax_ub, "bulk_all_gather"),
    reason="jax_ub.bulk_all_gather / bulk_reduce_scatter not implemented yet",
)


@needs_bulk
def test_bulk_impls_agree(cpu_mesh):
    from jax_ub.bench import bulk

    mesh = cpu_mesh(4)
    for kind in bulk.KINDS:
        impls = bulk.build(kind, mesh, 16, 8, 32, dtype_name="float32", cuda=False)
        assert "comm_jax_ub" not in impls
        outs = {}
        for name, thunk in impls.items():
            fn, args = thunk()
            outs[name] = fn(*args)
        (coll, gemm), (coll0, gemm0) = outs["jax_ub"], outs["xla_plain"]
        np.testing.assert_allclose(np.asarray(coll), np.asarray(coll0), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(gemm), np.asarray(gemm0), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(outs["comm_nccl"]), np.asarray(coll0), rtol=1e-6)
        lay = bulk.layout(kind, 16, 8, 32, 4)
        assert outs["gemm_alone"].shape == (lay["local"][0][0], lay["local"][1][1])


@needs_bulk
def test_bulk_cli(tmp_path):
    doc, stdout = _bench(["bulk", "--shapes", "64,32,128", "--tp", "4"], tmp_path)
    assert "path: xla-reference" in stdout and "jax_ub/max(gemm,ub_comm)" in stdout
    by_op = _by(doc["records"], "op")
    assert set(by_op) == {"bulk_ag", "bulk_rs"}
    for recs in by_op.values():
        assert {"gemm_alone", "comm_nccl", "xla_plain", "jax_ub"} <= {r["impl"] for r in recs}
        assert all(r["ms"] > 0 and (r["M"], r["K"], r["N"], r["tp"]) == (64, 32, 128, 4) for r in recs)


def test_bulk_missing_primitive_is_a_clear_error(monkeypatch):
    from jax_ub.bench import bulk

    monkeypatch.delattr(jax_ub, "bulk_all_gather", raising=False)
    with pytest.raises(NotImplementedError, match="bulk_all_gather does not exist"):
        bulk.primitive("ag")


def test_time_impls_interleaves_repetitions(capsys):
    # Each repetition times every impl once, in an order shuffled by the repetition (not the same
    # cyclic order every time); an impl that fails to build or to run is reported and has no record.
    import argparse

    calls = []

    def impl(name, fail_from=None):
        def fn(x):
            calls.append(name)
            if fail_from is not None and calls.count(name) >= fail_from:
                raise RuntimeError("boom")
            return x + 1

        return fn, (jnp.ones(4),)

    def broken():
        raise ValueError("cannot build")

    a = argparse.Namespace(warmup=1, iters=2, reps=6, settle_ms=0)
    out = harness.time_impls(
        "t",
        {"a": impl("a"), "b": lambda: impl("b"), "c": broken, "d": impl("d"), "e": impl("e", fail_from=2)},
        a,
    )
    assert sorted(out) == ["a", "b", "d"], out
    assert all(v > 0 for v in out.values()), out
    assert calls[:4] == ["a", "b", "d", "e"], calls  # the warm-ups
    # e fails at its first timed call (one call) and is dropped; the rest are bursts of 2.
    timed = calls[4:]
    assert timed.count("e") == 1, timed
    rest = [n for n in timed if n != "e"]
    assert all(rest[i] == rest[i + 1] for i in range(0, len(rest), 2)), rest
    bursts = rest[::2]
    per_rep = [bursts[3 * r : 3 * (r + 1)] for r in range(6)]
    assert all(sorted(rep) == ["a", "b", "d"] for rep in per_rep), per_rep
    assert len({tuple(rep) for rep in per_rep}) > 1, per_rep  # shuffled, not one fixed order
    err = capsys.readouterr().err
    assert "c failed: ValueError: cannot build" in err and "e failed: RuntimeError: boom" in err


def test_time_impls_settles_each_impl_before_timing_it():
    # With settle_ms > 0 every timed burst directly follows an untimed burst of the same impl.
    import argparse

    calls = []

    def impl(name):
        def fn(x):
            calls.append(name)
            return x + 1

        return fn, (jnp.ones(4),)

    a = argparse.Namespace(warmup=1, iters=2, reps=3, settle_ms=1e6)
    out = harness.time_impls("t", {"a": impl("a"), "b": impl("b")}, a)
    assert sorted(out) == ["a", "b"], out
    settle = harness.settle_calls(0.001, 1e6, 2)
    assert settle == 8  # capped at 4 * iters
    # warm-up (1) and the estimate (2) per impl, then per repetition and impl one run of
    # settle + iters calls of that impl alone.
    assert calls[:6] == ["a", "a", "a", "b", "b", "b"], calls
    runs = []
    for name in calls[6:]:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    merged = [n for n, c in runs for _ in range(c // (settle + 2))]
    assert all(c % (settle + 2) == 0 for _, c in runs), runs
    assert sorted(merged) == ["a"] * 3 + ["b"] * 3, runs
    assert harness.settle_calls(0.5, 25.0, 10) == 40 and harness.settle_calls(5.0, 25.0, 10) == 5
    assert harness.settle_calls(1.0, 0, 10) == 0


def test_chain_fn_runs_every_call_and_time_is_per_op():
    """--chain: the chained program runs the op N times (none dead, none merged), and time_impls
    reports the time per op: an op that sleeps 20 ms on the host measures about 20 ms, not N x 20."""
    import time
    from types import SimpleNamespace

    w = jnp.arange(12.0).reshape(3, 4)
    f = jax.jit(lambda x: jnp.tanh(x @ w))
    g = harness.chain_fn(f, 4)
    outs = g(jnp.ones((2, 3)))
    assert len(outs) == 4 and all(np.array_equal(o, f(jnp.ones((2, 3)))) for o in outs)
    # Each call reads its input through the previous call's barrier. (XLA's CPU pipeline expands
    # barriers early and then merges the dots; its GPU pipeline keeps them through CSE, checked
    # in tests/multigpu/test_tuning_cuda.py.)
    hlo = g.lower(jnp.ones((2, 3))).as_text()
    assert hlo.count("stablehlo.dot_general") == 4 and hlo.count("stablehlo.optimization_barrier") == 4
    assert harness.chain_fn(f, 1) is None
    assert harness.chain_fn(f.lower(jnp.ones((2, 3))).compile(), 4) is None  # not chainable

    def nap(x):
        time.sleep(0.02)
        return x

    slow = jax.jit(lambda x: jax.pure_callback(nap, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    a = SimpleNamespace(warmup=1, iters=1, reps=3, settle_ms=0, chain=4)
    ms = harness.time_impls("t", {"slow": (slow, (jnp.ones(3),))}, a)["slow"]
    assert 18 <= ms < 40, ms


def test_host_line_reports_the_slowest_device_per_op():
    """The bench's host line: per impl, the slowest device's host seconds per op over its bursts,
    and of it the wait for peers; impls that ran no jax_ub op (XLA, CPU) are left out."""

    def d(ops, host0, meet0, host1, meet1):
        return {
            ("tp", 0): {"ops": ops, "host_s": host0, "meet_s": meet0},
            ("tp", 1): {"ops": ops, "host_s": host1, "meet_s": meet1},
        }

    host = {
        "jax_ub": [d(10, 500e-6, 50e-6, 800e-6, 20e-6), d(10, 700e-6, 70e-6, 900e-6, 40e-6)],
        "xla_plain": [{}, {}],
        "gemm_alone": [],
    }
    # the slowest device is 1: 1700 us over 20 ops = 85 us, of it 60 us / 20 = 3 us waiting.
    assert harness.host_line(host) == "host us per op (of it waiting for peers): jax_ub 85 (3)"
    assert harness.host_line({"xla_plain": [{}]}) == ""
    before = {("tp", 0): {"ops": 3, "host_s": 1.0, "meet_s": 0.5}}
    after = {("tp", 0): {"ops": 5, "host_s": 1.25, "meet_s": 0.5}}
    assert harness._host_delta(before, after) == {("tp", 0): {"ops": 2, "host_s": 0.25, "meet_s": 0.0}}


def test_table_prints_split_floor_and_merged_push(capsys):
    """The ag table's last columns: T over max(the GEMM in tp row chunks, ub_comm); and, where the
    run timed both, push_merge over plain push, per shape (tp > 2: at tp=2 they are one program)."""
    r = {
        "gemm_alone": 1.0,
        "gemm_all_gpus": 1.1,
        "gemm_chunks": 1.2,
        "comm_nccl": 0.5,
        "comm_jax_ub": 0.4,
        "xla_plain": 2.0,
        "xla_windowed": 2.5,
        "jax_ub": 1.32,
        "jax_ub_push": 1.32,
        "jax_ub_ring": 1.5,
        "jax_ub_all_peer": 1.6,
        "jax_ub_push_merge": 1.254,
    }
    agrs._table("ag", [(4, 8192, 8192, 28672, r, "push")], "path: cuda")
    out = capsys.readouterr().out
    assert "(1.100, 1.20; 1.200, 1.10)" in out  # T/max(all GPUs, comm) 1.20; T/max(chunks, comm) 1.10
    assert "push_merge / push: tp4 8192,8192,28672 0.950" in out
    agrs._table("ag", [(2, 8192, 8192, 28672, r, "push")], "path: cuda")
    assert "push_merge / push" not in capsys.readouterr().out
    agrs._table(
        "ag",
        [(4, 8192, 8192, 28672, {k: v for k, v in r.items() if k != "jax_ub_push_merge"}, "push")],
        "path: cuda",
    )
    assert "push_merge / push" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# the command line: arguments checked before anything runs, runs that measure nothing fail


SMALL = ["--shapes", "64,32,64"]  # were a check missing, the run would stay short
MLP_SMALL = ["--hidden", "64", "--ffn", "128", "--tokens", "64"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["ag", "--tp", "2", "--shapes", "64,64"],
            "argument --shapes: expected M,K,N: three positive integers separated by commas (e.g. "
            "8192,8192,28672); got '64,64' (2 values)",
        ),
        (
            ["ag", "--tp", "2", "--shapes", "64,64,64", "64,64,abc"],
            "got '64,64,abc' ('abc' is not a positive integer)",
        ),
        (["bulk", "--shapes", "64,0,64"], "got '64,0,64' ('0' is not a positive integer)"),
        (["rs", "--shapes", "64,32,64,8"], "got '64,32,64,8' (4 values)"),
        # a tp no device count here allows: the malformed shape is still reported, not skipped
        (["ag", "--tp", "16", "--shapes", "64,64"], "argument --shapes: expected M,K,N"),
        (["ag", "--tp", "0", *SMALL], "argument --tp: must be >= 1; got 0"),
        (["bulk", "--tp", "4", "-2", *SMALL], "argument --tp: must be >= 1; got -2"),
        (["mlp", "--tp", "0", *MLP_SMALL], "argument --tp: must be >= 1; got 0"),
        (["mlp", *MLP_SMALL, "--tokens", "0"], "argument --tokens: must be >= 1; got 0"),
        (["rs", *SMALL, "--iters", "0"], "argument --iters: must be >= 1; got 0"),
        (["ag", *SMALL, "--iters", "many"], "argument --iters: expected an integer >= 1; got 'many'"),
        (["ag", *SMALL, "--reps", "0"], "argument --reps: must be >= 1; got 0"),
        (["bulk", *SMALL, "--chain", "0"], "argument --chain: must be >= 1; got 0"),
        (["tune", "shapes.json", "--chain", "0"], "argument --chain: must be >= 1; got 0"),
        (["ag", *SMALL, "--warmup", "-1"], "argument --warmup: must be >= 0; got -1"),
        (["rs", *SMALL, "--settle-ms", "-5"], "argument --settle-ms: must be >= 0; got -5"),
        (
            ["ag", *SMALL, "--dtype", "int8"],
            "argument --dtype: invalid choice: 'int8' (choose from 'bfloat16', 'float16', 'float32', 'fp8')",
        ),
        (["mlp", *MLP_SMALL, "--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
        (["rs", *SMALL, "--timeline-method", "push"], "argument --timeline-method: invalid choice: 'push'"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_bad_arguments_are_argparse_errors(argv, fragment, tmp_path, capsys):
    """A malformed shape, a count below its minimum or an unsupported dtype: argparse's `error:`
    (exit 2, stderr) naming the argument, what it expects and what it got; nothing runs."""
    with pytest.raises(SystemExit) as e:
        cli.main([argv[0], *FAST, *argv[1:], "--out", str(tmp_path)])  # argv's own values win
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and fragment in err, err
    assert list(tmp_path.iterdir()) == []


def test_shapes_are_parsed_once_and_the_timeline_methods_are_the_cuda_ones():
    a = cli._parser().parse_args(["ag", "--shapes", "64,32,64", " 8, 16,24"])
    assert a.shapes == [(64, 32, 64), (8, 16, 24)]
    assert harness._shapes(a, []) == [(64, 32, 64), (8, 16, 24)]
    from jax_ub import choice

    for op in ("ag", "rs"):  # bench ag|rs time a jax_ub_<method> impl for each of them
        assert cli.CUDA_METHODS[op] == tuple(m for m in choice.METHODS[op] if m != "xla")


def _broken(*args, **kwargs):
    raise RuntimeError("broken on purpose")


@pytest.mark.parametrize(
    ("op", "patch"),
    [
        ("ag", ["all_gather_matmul"]),
        ("rs", ["matmul_reduce_scatter"]),
        pytest.param("bulk", ["bulk_all_gather", "bulk_reduce_scatter"], marks=needs_bulk),
    ],
)
def test_a_run_whose_jax_ub_impls_all_failed_fails_and_writes_nothing(
    op, patch, tmp_path, capsys, monkeypatch
):
    """Every time of jax_ub's own impls failed (NaN in every jax_ub column): not exit 0 with a
    table of NaN, but exit 1 saying nothing was measured and why, and no JSON."""
    for name in patch:
        monkeypatch.setattr(jax_ub, name, _broken)
    rc = cli.main([op, "--tp", "2", "--shapes", "64,32,64", *FAST, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "error: nothing was measured: jax_ub's impls gave no time in any case of bench " + op in err, err
    label = {
        "ag": "ag tp=2 64x32x64 bfloat16",
        "rs": "rs tp=2 64x32x64 bfloat16",
        "bulk": "bulk_ag tp=2 64x32x64 bfloat16",
    }[op]
    assert f"jax_ub at {label}: RuntimeError: broken on purpose" in err, err
    assert "no file written" in err
    assert list(tmp_path.iterdir()) == []


def test_an_mlp_run_whose_models_all_failed_fails_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(mlp_bench, "build", _broken)
    rc = cli.main(
        [
            "mlp",
            "--tp",
            "2",
            "--hidden",
            "64",
            "--ffn",
            "128",
            "--tokens",
            "64",
            "--models",
            "mlp",
            *FAST,
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "error: nothing was measured" in err, err
    assert (
        "the case at mlp tp=2 hidden=64 ffn=128 tokens=64 bfloat16: RuntimeError: broken on purpose" in err
    ), err
    assert list(tmp_path.iterdir()) == []


def test_nothing_measured_only_when_no_case_timed_jax_ub(capsys):
    import argparse

    a = argparse.Namespace(op="ag")
    assert harness.nothing_measured(a, [{"xla_plain": 1.0}, {"jax_ub_ring": 2.0}], []) is None
    fails = [("xla_windowed", "c1: E: x")] + [("jax_ub", f"c{i}: E: y") for i in range(5)]
    assert harness.nothing_measured(a, [{"xla_plain": 1.0}], fails) == 1
    err = capsys.readouterr().err
    assert (
        "(expected at least one; jax_ub at c0: E: y; jax_ub at c1: E: y; jax_ub at c2: E: y; and 2 "
        "more (the lines above)); no file written" in err
    ), err
    assert "xla_windowed" not in err
    assert harness.nothing_measured(a, [], []) == 1
    assert "none of them was timed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# tune: no file that JAX_UB_TUNING_FILE would refuse


def _shapes_file(tmp_path: Path) -> Path:
    from jax_ub import tuning

    rec = tuning.Recording()
    rec.note(tuning.OpShape("ag", 2, "float32", 64, 32, 96), "forward")
    path = tmp_path / "shapes.json"
    rec.save(str(path))
    return path


def test_tune_off_the_cuda_path_fails_before_timing(tmp_path, capsys, monkeypatch):
    """On CPU only xla_plain and jax_ub (the reference) could be timed: no method to choose, so no
    file (the doctor would refuse it), exit 2 before anything is timed, saying why."""
    monkeypatch.setattr(harness, "time_impls", _broken)
    rc = cli.main(["tune", str(_shapes_file(tmp_path)), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (
        "error: nothing to tune on this machine: a tuning file needs the times of the "
        "jax_ub_<method> impls, which need the CUDA path (path: xla-reference (" in err
    ), err
    assert "no file written" in err
    assert not (tmp_path / "o").exists()


def test_tune_with_nothing_usable_measured_fails_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """On the CUDA path (stubbed), every jax_ub_<method> failed: one method per shape is no
    choice, so no tuning file; exit 1 naming the failures."""

    def fake_time(label, impls, a, failures=None, **kw):
        failures.extend((n, f"{label}: RuntimeError: no GPU") for n in impls if n.startswith("jax_ub_"))
        return {"xla_plain": 1.0, "jax_ub": 1.1}

    monkeypatch.setattr(harness, "path_info", lambda: (True, "path: cuda"))
    monkeypatch.setattr(
        harness, "make_mesh", lambda tp, cuda: jax.sharding.Mesh(jax.devices("cpu")[:tp], ("tp",))
    )
    monkeypatch.setattr(harness, "time_impls", fake_time)
    monkeypatch.setattr(agrs, "auto_method", lambda *a: "push")
    rc = cli.main(["tune", str(_shapes_file(tmp_path)), "--out", str(tmp_path / "o"), "--machine", "box"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert (
        "error: nothing usable was measured: a tuning file needs, at some shape, the times of two or "
        "more methods (jax_ub_<method> or xla_plain); got times of jax_ub, xla_plain only (jax_ub_push "
        "at tune ag tp2 float32 64x32x96 (forward, 1 calls): RuntimeError: no GPU" in err
    ), err
    assert "no file written" in err
    assert not list((tmp_path / "o").glob("*.json"))


def test_a_record_file_says_which_gpus_and_jax_ub_measured_it(tmp_path):
    """What a tuning file's reader compares with its own GPUs and version (choice.check_bench_file),
    written whole or not at all (a job may be reading it as its JAX_UB_TUNING_FILE)."""
    import argparse

    a = argparse.Namespace(machine="box", date="20261123", chain=1)
    stem = str(tmp_path / "box-20261123-ag")
    harness.write_json(a, stem, [{"op": "ag_gemm", "impl": "xla_plain", "ms": 1.0}], path="cuda")
    doc = json.loads((tmp_path / "box-20261123-ag.json").read_text())
    assert doc["jax_ub"] == jax_ub.__version__ and doc["device_kind"] == jax.devices()[0].device_kind
    assert doc["machine"] == "box" and doc["path"] == "cuda" and len(doc["records"]) == 1
    with pytest.raises(TypeError):  # a record that cannot be written: the old file stays whole
        harness.write_json(a, stem, [{("op", 1): "a tuple key: not JSON"}])
    assert json.loads((tmp_path / "box-20261123-ag.json").read_text()) == doc
    assert [p.name for p in tmp_path.iterdir()] == ["box-20261123-ag.json"]


# ------------------------------------------------------------------------------------------------
# Defaults per subcommand, checked outputs, chain per record, per-case files


def test_each_subcommand_has_its_own_defaults():
    """tune's --out and --chain defaults are its own: ag/rs/bulk time one op per dispatch into
    bench_out unless told otherwise (argparse shares a parent's actions between subparsers)."""
    p = cli._parser()
    for op in ("ag", "rs", "bulk"):
        a = p.parse_args([op])
        assert (a.out, a.chain) == ("bench_out", 1), op
    a = p.parse_args(["mlp"])
    assert a.out == "bench_out" and not hasattr(a, "chain")
    a = p.parse_args(["tune", "x.json"])
    assert (a.out, a.chain) == ("jax_ub_tuning", 8)
    a = p.parse_args(["ag", "--chain", "4", "--out", "o"])  # and given values still win
    assert (a.out, a.chain) == ("o", 4) and p.parse_args(["rs"]).chain == 1


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x y"])
def test_machine_is_a_plain_name(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["ag", *SMALL, *FAST, "--out", str(tmp_path), "--machine", name])
    assert e.value.code == 2
    assert "argument --machine: expected a plain name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_repeated_tp_and_shapes_run_once():
    import argparse

    a = argparse.Namespace(tp=[2, 2, 1], shapes=[(64, 32, 64), (64, 32, 64), (8, 8, 8)])
    assert list(harness.cases(a, [])) == [(2, 64, 32, 64), (2, 8, 8, 8), (1, 64, 32, 64), (1, 8, 8, 8)]


def test_a_warm_up_call_always_precedes_timing():
    """--warmup 0 --settle-ms 0: the first call (the compile) is still run untimed."""
    from types import SimpleNamespace

    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) == 1:
            import time

            time.sleep(0.3)  # a compile
        return x

    a = SimpleNamespace(warmup=0, iters=1, reps=1, settle_ms=0)
    ms = harness.time_impls("t", {"f": (fn, (jnp.ones(3),))}, a)["f"]
    assert len(calls) == 2 and ms < 100, (calls, ms)
    harness.time_fn(fn, (jnp.ones(3),), warmup=0, iters=1, reps=1)
    assert len(calls) == 4


def test_check_compares_each_impl_with_its_reference(capsys):
    """The correctness probe: jax_ub*/xla_windowed/variant_* against xla_plain, comm_jax_ub against
    comm_nccl; the error is returned; above the dtype's bound, NaN, or an output of another
    structure (an extra array, as return_gathered gives) is a WrongOutput."""
    ref = jnp.linspace(1.0, 2.0, 64).reshape(8, 8)
    check = harness.Check("bfloat16")
    assert check("gemm_alone", ref * 3) is None  # nothing to compare with
    assert check("xla_plain", ref) is None and check("comm_nccl", ref + 1) is None
    assert check("jax_ub", ref) == 0.0
    assert 0 < check("jax_ub_push", ref * (1 + 5e-3)) < 1e-2
    assert check("comm_jax_ub", ref + 1) == 0.0
    for name, out, why in [
        ("jax_ub", ref * 1.02, "relative error 0.02 against xla_plain (bound 0.01 in bfloat16)"),
        ("xla_windowed", ref.at[0, 0].set(jnp.nan), "relative error nan"),
        ("xla_windowed_nccl", ref * 0.5, "relative error 0.5 against xla_plain"),
        ("comm_jax_ub", ref, "against comm_nccl"),
        ("variant_push_merge", (ref, ref), "is not the reference's"),
    ]:
        with pytest.raises(harness.WrongOutput, match=re.escape(why)):
            check(name, out)
    f32 = harness.Check("float32")
    f32("xla_plain", ref)
    with pytest.raises(harness.WrongOutput, match=re.escape("bound 0.0001 in float32")):
        f32("jax_ub", ref * (1 + 5e-4))
    assert harness.Check("float32")("jax_ub", ref) is None  # its reference gave no output
    assert "jax_ub: output not checked (xla_plain gave none)" in capsys.readouterr().err


def test_a_wrong_output_gets_no_time_and_a_failure():
    """Through time_impls: the probe sees one op's output (the last of a chained call), and an impl
    whose output is wrong is not timed; its failure says why."""
    from types import SimpleNamespace

    x = jnp.arange(12.0).reshape(3, 4)
    impls = {
        "xla_plain": (jax.jit(lambda x: x * 2), (x,)),
        "jax_ub": (jax.jit(lambda x: x * 2 + 1e-4), (x,)),
        "jax_ub_ring": (jax.jit(lambda x: x * 3), (x,)),
    }
    errs: dict = {}
    failures: list = []
    a = SimpleNamespace(warmup=1, iters=1, reps=1, settle_ms=0, chain=3)
    res = harness.time_impls("t", impls, a, probe=harness.Check("float32"), probes=errs, failures=failures)
    assert sorted(res) == ["jax_ub", "xla_plain"] and res.chain == {"jax_ub": 3, "xla_plain": 3}
    assert errs["xla_plain"] is None and 0 < errs["jax_ub"] < 1e-4
    assert failures == [
        (
            "jax_ub_ring",
            "t: WrongOutput: wrong output: relative error 0.5 against xla_plain (bound 0.0001 in float32)",
        )
    ]
    recs = harness.case_records({"op": "x"}, res, errs)
    assert {r["impl"]: (r["chain"], r.get("rel_err")) for r in recs} == {
        "xla_plain": (3, None),
        "jax_ub": (3, float(f"{errs['jax_ub']:.3g}")),
    }


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_a_wrong_jax_ub_op_is_not_timed(op, tmp_path, capsys, monkeypatch):
    """An overlapped op that computes something else (here: twice the result) gives no record and
    no file (on CPU it is the only jax_ub impl), saying so; xla_windowed is checked too."""
    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    real = getattr(jax_ub, name)
    monkeypatch.setattr(jax_ub, name, lambda *args, **kw: 2 * real(*args, **kw))
    rc = cli.main([op, "--tp", "2", *SMALL, *FAST, "--out", str(tmp_path / "new")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert (
        f"jax_ub at {op} tp=2 64x32x64 bfloat16: WrongOutput: wrong output: relative error 1 against "
        f"xla_plain (bound 0.01 in bfloat16)" in err
    ), err
    assert not (tmp_path / "new").exists()  # no folder either: nothing was measured


def test_records_say_their_chain_and_error(tmp_path, capsys):
    """--chain 2 on CPU: the jitted impls chained, xla_windowed (compiled) not: each record says its
    own chain, the header states none, and the table says which impls were not chained."""
    rc = cli.main(
        ["rs", "--tp", "2", *SMALL, *FAST, "--chain", "2", "--out", str(tmp_path), "--machine", "box"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert (
        "timed one op per dispatch (not chainable; the others chained): xla_windowed, xla_windowed_nccl"
        in out
    )
    assert "tp=2: geometric mean speedup vs xla_plain: " in out and "x over 1 of 1 shapes" in out
    doc = json.loads(next(tmp_path.glob("box-*-rs.json")).read_text())
    assert "chain" not in doc and doc["complete"] is True and doc["failures"] == [] and doc["config"] == {}
    recs = {r["impl"]: r for r in doc["records"]}
    assert recs["xla_windowed"]["chain"] == recs["xla_windowed_nccl"]["chain"] == 1
    assert recs["jax_ub"]["chain"] == recs["xla_plain"]["chain"] == 2
    assert recs["jax_ub"]["rel_err"] <= 1e-2 and recs["xla_windowed"]["rel_err"] <= 1e-2
    assert recs["xla_windowed_nccl"]["rel_err"] <= 1e-2
    assert "rel_err" not in recs["xla_plain"] and "rel_err" not in recs["gemm_alone"]
    for r in doc["records"]:  # one burst (--reps 1): its range is the median itself
        assert r["ms_min"] == r["ms"] == r["ms_max"] > 0, r


def test_records_carry_the_spread_of_their_bursts(monkeypatch):
    """Each record keeps the fastest and slowest of its impl's bursts around their median: an impl
    whose bursts are 1, 2 and 5 ms per call (chained 2: per op half that) records 0.5/1.0/2.5."""
    from types import SimpleNamespace

    x = jnp.arange(4.0)
    times = iter([1.0, 2.0, 5.0])  # ms per call of the three timed bursts
    real = harness._burst
    impls = {"jax_ub": (jax.jit(lambda x: x + 1), (x,))}
    a = SimpleNamespace(warmup=1, iters=1, reps=3, settle_ms=0, chain=2)
    monkeypatch.setattr(
        harness, "_burst", lambda fn, args, iters: next(times) if iters == a.iters else real(fn, args, iters)
    )
    res = harness.time_impls("t", impls, a)
    (r,) = harness.case_records({"op": "x"}, res)
    assert (r["ms_min"], r["ms"], r["ms_max"], r["chain"]) == (0.5, 1.0, 2.5, 2)


def test_records_carry_host_time_per_op_of_jax_ub_impls(monkeypatch):
    """An impl whose ops the FFI handlers counted records its host us per op (the slowest
    device's, and of it the wait for peers); one that ran no jax_ub op records none. Fake counters:
    every timed burst of "jax_ub" runs 4 ops per device, device 1 spending 100 us per op (10 of
    it waiting), device 0 60 us; "xla_plain" moves no counter."""
    from types import SimpleNamespace

    x = jnp.arange(4.0)
    clock = {"ops": 0, "h0": 0.0, "h1": 0.0, "m1": 0.0}
    real = harness._burst

    def burst(fn, args, iters):
        out = real(fn, args, iters)
        if fn is impls["jax_ub"][0] and iters == a.iters:
            clock["ops"] += 4
            clock["h0"] += 4 * 60e-6
            clock["h1"] += 4 * 100e-6
            clock["m1"] += 4 * 10e-6
        return out

    def stats():
        return {
            ("tp", 0): {"ops": clock["ops"], "host_s": clock["h0"], "meet_s": 0.0},
            ("tp", 1): {"ops": clock["ops"], "host_s": clock["h1"], "meet_s": clock["m1"]},
        }

    impls = {"jax_ub": (jax.jit(lambda x: x + 1), (x,)), "xla_plain": (jax.jit(lambda x: x * 2), (x,))}
    a = SimpleNamespace(warmup=1, iters=2, reps=3, settle_ms=0, chain=1)
    monkeypatch.setattr(harness, "_burst", burst)
    monkeypatch.setattr(harness, "_host_stats", stats)
    res = harness.time_impls("t", impls, a)
    recs = {r["impl"]: r for r in harness.case_records({"op": "x"}, res)}
    assert (recs["jax_ub"]["host_us"], recs["jax_ub"]["host_meet_us"]) == (100.0, 10.0)
    assert "host_us" not in recs["xla_plain"] and "host_meet_us" not in recs["xla_plain"]
    assert "host_us" not in harness.case_records({"op": "x"}, {"jax_ub": 1.0})[0]


def test_ratios_of_impls_of_different_chains_are_flagged(capsys):
    r = harness.Times(
        {
            "gemm_alone": 1.0,
            "comm_jax_ub": 0.4,
            "xla_plain": 2.0,
            "jax_ub": 1.25,
            "jax_ub_push": 1.25,
            "jax_ub_push_merge": 1.2,
        },
        {
            "gemm_alone": 4,
            "comm_jax_ub": 4,
            "xla_plain": 4,
            "jax_ub": 4,
            "jax_ub_push": 4,
            "jax_ub_push_merge": 1,
        },
    )
    assert (
        harness.ratio(r, "xla_plain", "jax_ub") == 1.6
        and harness.ratio(r, "jax_ub", "gemm_alone", "comm_jax_ub") == 1.25
    )
    assert math.isnan(harness.ratio(r, "jax_ub_push_merge", "jax_ub_push"))
    assert math.isnan(harness.ratio(r, "xla_plain", "xla_windowed"))  # missing
    agrs._table(
        "ag",
        [
            (4, 8192, 8192, 8192, r, "push"),
            (4, 2048, 8192, 28672, harness.Times(), "-"),
            (2, 8192, 8192, 8192, r, "push"),
        ],
        "path: cuda",
    )
    out = capsys.readouterr().out
    assert "push_merge / push: tp4 8192,8192,8192 n/a (chain 1 against 4)" in out
    assert "timed one op per dispatch (not chainable; the others chained): jax_ub_push_merge" in out
    # one geometric mean per tp, over the shapes that have both times
    assert "tp=4: geometric mean speedup vs xla_plain: 1.60x over 1 of 2 shapes" in out
    assert "tp=2: geometric mean speedup vs xla_plain: 1.60x over 1 of 1 shapes" in out


def test_a_failing_case_does_not_cost_the_others(tmp_path, capsys, monkeypatch):
    """A case whose data or impls cannot be made fails alone (a failure in the file, impl "*");
    the others are timed and written, and jax_ub.shutdown runs after every case."""
    real = agrs.build
    shutdowns = []

    def build(op, mesh, M, *rest, **kw):
        if M == 128:
            raise MemoryError("out of memory making x")
        return real(op, mesh, M, *rest, **kw)

    monkeypatch.setattr(agrs, "build", build)
    monkeypatch.setattr(jax_ub, "shutdown", lambda: shutdowns.append(1))
    rc = cli.main(
        [
            "ag",
            "--tp",
            "2",
            "--shapes",
            "128,32,64",
            "64,32,64",
            *FAST,
            "--out",
            str(tmp_path),
            "--machine",
            "box",
        ]
    )
    assert rc == 0 and len(shutdowns) == 2
    assert "the case failed: MemoryError: out of memory making x" in capsys.readouterr().err
    doc = json.loads(next(tmp_path.glob("box-*-ag.json")).read_text())
    assert {r["M"] for r in doc["records"]} == {64} and doc["complete"] is True
    assert doc["failures"] == [
        {
            "op": "ag_gemm",
            "M": 128,
            "K": 32,
            "N": 64,
            "tp": 2,
            "dtype": "bfloat16",
            "impl": "*",
            "error": "MemoryError: out of memory making x",
        }
    ]


def test_the_file_is_written_after_every_case(tmp_path, monkeypatch):
    """A run killed after its first case (here: an interrupt while building the second) leaves the
    first case's records, marked incomplete."""
    real = agrs.build

    class Killed(BaseException):
        pass

    def build(op, mesh, M, *rest, **kw):
        if M == 128:
            raise Killed
        return real(op, mesh, M, *rest, **kw)

    monkeypatch.setattr(agrs, "build", build)
    with pytest.raises(Killed):
        cli.main(
            [
                "ag",
                "--tp",
                "2",
                "--shapes",
                "64,32,64",
                "128,32,64",
                *FAST,
                "--out",
                str(tmp_path),
                "--machine",
                "box",
            ]
        )
    doc = json.loads(next(tmp_path.glob("box-*-ag.json")).read_text())
    assert doc["complete"] is False and {r["M"] for r in doc["records"]} == {64}
    assert not list(tmp_path.glob("*.png"))  # the chart comes at the end


def test_the_header_names_the_settings_away_from_their_defaults(tmp_path):
    import argparse

    a = argparse.Namespace(machine="box", date="20261125")
    with jax_ub.config.override(ag_push_merge=True, gemm_tune=0):
        harness.write_json(
            a, str(tmp_path / "new" / "box"), [{"impl": "x", "chain": 2}, {"impl": "y", "chain": 2}]
        )
    doc = json.loads((tmp_path / "new" / "box.json").read_text())
    assert doc["config"] == {"gemm_tune": 0, "ag_push_merge": True} and doc["chain"] == 2


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_a_missing_impl_is_a_gap_in_the_chart(tmp_path, monkeypatch):
    import matplotlib.axes

    texts = []
    real = matplotlib.axes.Axes.text
    monkeypatch.setattr(
        matplotlib.axes.Axes, "text", lambda self, *a, **k: texts.append(a[2]) or real(self, *a, **k)
    )
    recs = [
        {"c": "one", "impl": "a", "ms": 1.0},
        {"c": "one", "impl": "b", "ms": 2.0},
        {"c": "two", "impl": "a", "ms": 1.5},
    ]
    assert harness.plot(recs, str(tmp_path / "x.png"), "t", ["a", "b"], lambda r: r["c"])
    assert texts == ["n/a"]
