"""CPU tier: ``python -m jax_ub.bench layer`` at tiny sizes on 4 simulated devices (the reference
path), and the pieces its records are made of (FLOPs, MFU, E, the Chrome/Perfetto trace)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax_ub
from jax_ub.bench import __main__ as cli
from jax_ub.bench import layer, timeline

REPO = Path(__file__).resolve().parents[2]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
TINY = ["--hidden", "64", "--heads", "8", "--kv-heads", "4", "--head-dim", "16", "--ffn", "128"]
TINY += ["--seq", "32", "--batch", "2", "--tp", "4"]
FAST = ["--warmup", "1", "--iters", "2", "--reps", "2", "--settle-ms", "0"]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=4"])
    for name in jax_ub.config.KNOB_VARIABLES:  # the bench's defaults, whatever the caller set
        env.pop(name, None)
    return env


def _run(args: list[str], out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jax_ub.bench", "layer", *args, "--out", str(out), "--machine", "test-box"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_file_names_say_the_preset_or_the_sizes():
    """Runs of the 8b and 70b presets on one day write different files; changed sizes say so."""
    base = dict(seq=4096, batch=1, tp=4)
    assert layer.stem_tag(layer.Shape(**layer.PRESETS["8b"], **base)) == "layer-8b"
    assert layer.stem_tag(layer.Shape(**layer.PRESETS["70b"], **base, preset="70b")) == "layer-70b"
    custom = {**layer.PRESETS["70b"], "ffn": 1024}
    assert layer.stem_tag(layer.Shape(**custom, **base, preset="70b")) == "layer-h8192-f1024"
    assert layer.stem_tag(layer.Shape(**layer.PRESETS["8b"], **base), fp8=True) == "layer-8b-fp8"
    assert layer.stem_tag(layer.Shape(**custom, **base, preset="70b"), fp8=True) == "layer-h8192-f1024-fp8"


def test_layer_cli_records_e_trace_and_xla_cm(tmp_path):
    """One case at tp=4 with every impl (xla_cm forced on: its subprocess runs on CPU too): the
    record's fields, E from the recorded times, the check of jax_ub and xla_cm against xla, the
    chart and the trace file that says there is no CUDA timeline."""
    proc = _run([*TINY, *FAST, "--remat", "none", "--xla-cm", "on"], tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    (path,) = tmp_path.glob("test-box-*-layer-h64-f128.json")
    doc = json.loads(path.read_text())
    assert doc["path"] == "xla-reference" and doc["complete"] and doc["failures"] == []
    by = {r["impl"]: r for r in doc["records"]}
    assert set(by) == {"xla", "xla_cm", "jax_ub", "no_comm"}
    s = layer.Shape(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128, seq=32, batch=2, tp=4)
    for impl, r in by.items():
        assert (r["op"], r["hidden"], r["heads"], r["kv_heads"], r["head_dim"], r["ffn"]) == (
            "layer",
            64,
            8,
            4,
            16,
            128,
        )
        assert (r["seq"], r["batch"], r["tokens"], r["tp"], r["dtype"], r["remat"]) == (
            32,
            2,
            64,
            4,
            "bfloat16",
            "none",
        )
        assert r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"], impl
        assert r["model_flops"] == layer.model_flops(s)
        assert r["tokens_per_s"] == pytest.approx(64 / (r["ms"] * 1e-3), rel=1e-3)
        assert r["tflops"] == pytest.approx(r["model_flops"] / (r["ms"] * 1e-3) / 1e12, abs=1e-3)
        assert r["peak_tflops"] is None and r["mfu"] is None  # no peak for a CPU
    assert by["jax_ub"]["rel_err"] <= layer.STEP_ERR_BOUND["bfloat16"]
    assert by["xla_cm"]["check_rel_err"] <= layer.STEP_ERR_BOUND["bfloat16"]
    ms = {k: r["ms"] for k, r in by.items()}
    if ms["xla"] > ms["no_comm"]:
        expected = (ms["xla"] - ms["jax_ub"]) / (ms["xla"] - ms["no_comm"])
        assert by["jax_ub"]["E"] == pytest.approx(expected, abs=1e-4)
        assert "E_why" not in by["jax_ub"]
    else:
        assert by["jax_ub"]["E"] is None and "exposes no communication" in by["jax_ub"]["E_why"]
    assert all("E" not in r for k, r in by.items() if k != "jax_ub")
    # The same step: jax_ub's and xla_cm's (loss, |dx|) are xla's.
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("remat=none check")]
    assert "xla (" in line and "jax_ub (" in line and "xla_cm (" in line
    trace = json.loads(path.with_name(path.stem + "-trace.json").read_text())
    assert trace["traceEvents"] and "no CUDA timeline" in trace["otherData"]["note"]
    if HAVE_MPL:
        assert path.with_suffix(".png").stat().st_size > 0


def test_layer_cli_fp8(tmp_path):
    """--fp8 at tp=4: jax_ub, xla and no_comm with the default recipe, xla_cm skipped with its
    reason printed and recorded; the records say fp8, the recipe's dtypes and whether the step ran
    FP8 GEMMs (jax_ub's and xla's do); jax_ub's step checked against xla's within the FP8 bound."""
    proc = _run([*TINY, *FAST, "--remat", "none", "--fp8"], tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    (path,) = tmp_path.glob("test-box-*-layer-h64-f128-fp8.json")
    doc = json.loads(path.read_text())
    assert doc["complete"] and doc["failures"] == []
    by = {r["impl"]: r for r in doc["records"]}
    assert set(by) == {"xla", "jax_ub", "no_comm"}
    recipe = {
        "fwd_dtype": "float8_e4m3fn",
        "bwd_dtype": "float8_e5m2",
        "out_dtype": None,
        "fwd_fast_accum": False,
    }
    for r in by.values():
        assert r["fp8"] is True and r["fp8_recipe"] == recipe and r["dtype"] == "bfloat16"
        assert r["skipped"]["xla_cm"].startswith("--fp8: the jit-partitioned layer")
        assert isinstance(r["fp8_gemms"], bool) and r["ms"] > 0
    # every impl's step multiplies float8 operands, the no_comm floor's stand-ins too
    assert by["xla"]["fp8_gemms"] and by["jax_ub"]["fp8_gemms"] and by["no_comm"]["fp8_gemms"]
    assert by["jax_ub"]["rel_err"] <= layer.STEP_ERR_BOUND_FP8
    assert "xla_cm: skipped: --fp8" in proc.stdout
    assert "bfloat16 fp8 (jax_ub.FP8Recipe())" in proc.stdout
    assert path.with_name(path.stem + "-trace.json").exists()


def test_fp8_gemms_sees_the_float8_dots(monkeypatch):
    """What a record's fp8_gemms says: xla's step with the recipe multiplies float8 operands, the
    same step without it (or the float32 dot of dequantized operands) does not."""
    import jax_ub
    from jax_ub.bench import harness

    s = layer.Shape(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128, seq=32, batch=2, tp=2)
    mesh = harness.make_mesh(2, False)
    for recipe in (jax_ub.FP8Recipe(), None):
        (thunk,) = layer.build(s, mesh, "bfloat16", "none", ("xla",), recipe).values()
        assert layer.fp8_gemms(thunk) is (recipe is not None)
    monkeypatch.setattr(jax_ub.fp8, "scaled_dot", jax_ub.fp8.scaled_matmul)  # the reference's dots
    (thunk,) = layer.build(s, mesh, "bfloat16", "none", ("xla",), jax_ub.FP8Recipe()).values()
    assert layer.fp8_gemms(thunk) is False
    assert layer.recipe_fields(None) == {"fp8": False}


def test_layer_cli_refuses_heads_that_do_not_divide(tmp_path, capsys):
    assert cli.main(["layer", *TINY[:-2], "--tp", "3", "--out", str(tmp_path)]) == 2
    assert "--heads (8) must be divisible by --tp (3)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------
# The pieces


def _args(**kw) -> argparse.Namespace:
    a = cli._parser().parse_args(["layer"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_presets_and_overrides():
    assert layer.shape_of(_args()) == layer.Shape(4096, 32, 8, 128, 14336, 4096, 1, 4)
    s = layer.shape_of(_args(preset="70b", tp=8, ffn=1024))
    assert (s.hidden, s.heads, s.kv_heads, s.head_dim, s.ffn, s.preset) == (8192, 64, 8, 128, 1024, "70b")
    assert tuple(layer.PRESETS) == cli.LAYER_PRESETS


@pytest.mark.parametrize(
    "change, message",
    [
        ({"heads": 6, "kv_heads": 4}, "--heads (6) must be a multiple of --kv-heads (4)"),
        ({"kv_heads": 2, "tp": 4}, "--kv-heads (2) must be divisible by --tp (4)"),
        ({"ffn": 130}, "--ffn (130) must be divisible by --tp (4)"),
        ({"seq": 30}, "--seq (30) must be divisible by --tp (4)"),
        ({"head_dim": 15}, "--head-dim (15) must be even"),
    ],
)
def test_shape_problems(change, message):
    base = dict(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128, seq=32, batch=1, tp=4)
    assert layer.Shape(**(base | change)).problem().startswith(message)
    assert layer.Shape(**base).problem() is None


def test_model_flops_counts_each_gemm_and_causal_attention():
    """The 8B-class preset at seq 4096: every GEMM of the layer counted from its matrices."""
    s = layer.shape_of(_args(tp=1))
    t, hd = 4096, 128
    mats = [(4096, 32 * hd), (4096, 8 * hd), (4096, 8 * hd), (32 * hd, 4096)]  # q, k, v, o
    mats += [(4096, 14336), (4096, 14336), (14336, 4096)]  # gate, up, down
    gemms = sum(2 * t * k * n for k, n in mats)
    attention = 2 * (2 * t * t * hd * 32) // 2  # QK^T and PV over 32 heads, half of it causal
    assert layer.model_flops(s) == 3 * (gemms + attention)
    r = layer.throughput(s, 10.0, 989.4)
    assert r["mfu"] == pytest.approx(layer.model_flops(s) / 10e-3 / 1e12 / 989.4, abs=1e-4)
    assert layer.peak_tflops("NVIDIA H200", "bfloat16") == 989.4
    assert (
        layer.peak_tflops("NVIDIA H200", "float32") is None and layer.peak_tflops("cpu", "bfloat16") is None
    )


def test_hidden_fraction():
    ms = {"xla": 10.0, "jax_ub": 9.5, "no_comm": 9.0}
    assert layer.hidden_fraction(ms, 4) == (pytest.approx(0.5), "")
    assert layer.hidden_fraction({**ms, "jax_ub": 10.5}, 4)[0] == pytest.approx(-0.5)
    e, why = layer.hidden_fraction(ms, 1)
    assert e is None and why.startswith("tp=1")
    e, why = layer.hidden_fraction({"xla": 10.0, "jax_ub": 9.0}, 4)
    assert e is None and why == "no time for no_comm"
    e, why = layer.hidden_fraction({**ms, "no_comm": 10.0}, 4)
    assert e is None and "exposes no communication" in why


def test_xla_cm_runs_where_asked():
    assert layer.xla_cm_reason(_args(tp=4), cuda=True) == ""
    assert layer.xla_cm_reason(_args(tp=1), cuda=True).startswith("tp=1")
    assert layer.xla_cm_reason(_args(tp=4), cuda=False).startswith("off the CUDA path")
    assert layer.xla_cm_reason(_args(tp=1, xla_cm="on"), cuda=False) == ""
    assert layer.xla_cm_reason(_args(tp=4, xla_cm="off"), cuda=True) == "--xla-cm off"
    assert layer.xla_cm_reason(_args(tp=4, xla_cm="on", fp8=True), cuda=True).startswith("--fp8: ")
    flags = layer.xla_flags("--xla_dump_to=/tmp/x")
    assert flags.split() == [
        "--xla_dump_to=/tmp/x",
        "--xla_gpu_threshold_for_windowed_einsum_mib=0",
        "--xla_gpu_multi_streamed_windowed_einsum=true",
    ]


def _span(dev, epoch, name, chunk, stream, s, e, op_start):
    return {
        "device": dev,
        "rank": dev,
        "op": "all_gather_matmul" if epoch % 2 else "matmul_reduce_scatter",
        "epoch": epoch,
        "name": name,
        "chunk": chunk,
        "stream": stream,
        "start_ms": s,
        "end_ms": e,
        "op_start_ms": op_start,
    }


def test_chrome_trace_of_a_step():
    """Two ops on two devices: one process per device, a thread per stream after the ops lane, each
    step at op_start + start (us), and one span per op covering its steps."""
    recs = [
        _span(0, 1, "copy", 1, "comm0", 0.0, 0.2, 0.0),
        _span(0, 1, "gemm", 0, "compute0", 0.05, 0.3, 0.0),
        _span(0, 2, "gemm", -1, "compute0", 0.0, 0.4, 1.0),
        _span(1, 1, "copy", 0, "comm0", 0.01, 0.25, 0.0),
    ]
    doc = timeline.chrome_trace(recs, title="t")
    json.dumps(doc)  # plain JSON
    ev = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert names == {
        (1000, 0): "jax_ub ops",
        (1000, 1): "comm0",
        (1000, 2): "compute0",
        (1001, 0): "jax_ub ops",
        (1001, 1): "comm0",
    }
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert procs == {1000: "jax_ub GPU 0", 1001: "jax_ub GPU 1"}
    spans = [e for e in ev if e["ph"] == "X"]
    steps = [e for e in spans if e["cat"] != "op"]
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in steps] == [
        ("copy 1", 1000, 1, 0.0, 200.0),
        ("gemm 0", 1000, 2, 50.0, 250.0),
        ("gemm", 1000, 2, 1000.0, 400.0),
        ("copy 0", 1001, 1, 10.0, 240.0),
    ]
    ops = sorted((e["pid"], e["name"], e["ts"], e["dur"]) for e in spans if e["cat"] == "op")
    assert ops == [
        (1000, "all_gather_matmul", 0.0, 300.0),
        (1000, "matmul_reduce_scatter", 1000.0, 400.0),
        (1001, "all_gather_matmul", 10.0, 240.0),
    ]
    assert doc["otherData"]["ops"] == 3 and doc["otherData"]["records"] == 4
    empty = timeline.chrome_trace([], title="t", note="no CUDA timeline")
    assert [e for e in empty["traceEvents"] if e["ph"] == "X"] == []
    assert empty["otherData"]["note"] == "no CUDA timeline"
    assert not math.isnan(doc["traceEvents"][0]["pid"])


COLLECTIVES = {"all_gather", "reduce_scatter", "psum", "psum_scatter", "ppermute", "all_to_all"}


def _count(jaxpr, prims, names) -> None:
    for eqn in jaxpr.eqns:
        prims[eqn.primitive.name] = prims.get(eqn.primitive.name, 0) + 1
        if eqn.primitive.name == "name":
            names[eqn.params["name"]] = names.get(eqn.params["name"], 0) + 1
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _count(inner, prims, names)


def test_the_floor_has_no_collective_and_runs_jax_ubs_gemms():
    """The traced steps at tp=4: xla's layer gathers and scatters around each of its 4 GEMMs
    (QKV, O, up, down), the no_comm floor has no collective at all and runs those 4 GEMMs through
    jax_ub.gemm.matmul (its output's checkpoint name)."""
    import jax

    from jax_ub.bench import harness

    s = layer.Shape(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128, seq=32, batch=2, tp=4)
    impls = layer.build(s, harness.make_mesh(4, False), "bfloat16", "none", ("xla", "no_comm"))
    counts = {}
    for impl, thunk in impls.items():
        fn, args = thunk()
        prims: dict[str, int] = {}
        names: dict[str, int] = {}
        _count(jax.make_jaxpr(fn)(*args).jaxpr, prims, names)
        counts[impl] = ({p: n for p, n in prims.items() if p in COLLECTIVES}, names)
    assert counts["xla"][0] == {"all_gather": 4, "reduce_scatter": 4}
    assert counts["no_comm"] == ({}, {"jax_ub_matmul_out": 4})


def test_xla_cm_result_joins_its_case_only_when_it_checks_out():
    """The subprocess's result: timed and matching xla's (loss, |dx|) → a time with chain 1 and its
    spread; an error or another (loss, |dx|) → a failure and no time."""
    from jax_ub.bench import harness

    def case():
        probe = layer.StepCheck("bfloat16")
        probe.checks["xla"] = (2.0, 4.0)
        return harness.Case(res=harness.Times({"xla": 3.0}, {"xla": 1})), probe, []

    c, probe, failures = case()
    got = {"ms": 2.5, "ms_min": 2.4, "ms_max": 2.7, "check": [2.01, 4.0]}
    layer._add_xla_cm(c, got, probe, "L", failures)
    assert (c.res["xla_cm"], c.res.chain["xla_cm"], c.res.spread["xla_cm"]) == (2.5, 1, (2.4, 2.7))
    assert c.extra["xla_cm"] == {"check_rel_err": 0.005} and failures == []
    c, probe, failures = case()
    layer._add_xla_cm(c, {**got, "check": [2.5, 4.0]}, probe, "L", failures)
    assert "xla_cm" not in c.res and failures[0][0] == "xla_cm" and "wrong output" in failures[0][1]
    c, probe, failures = case()
    layer._add_xla_cm(c, {"error": "RuntimeError: boom"}, probe, "L", failures)
    assert "xla_cm" not in c.res and failures == [("xla_cm", "L: RuntimeError: boom")]


def test_trace_file_of_a_traced_step(tmp_path, monkeypatch):
    """On the CUDA path at tp > 1 the trace file holds the traced step's spans (capture_timeline
    faked with two ops' records); at tp=1 and off the CUDA path, a note and no span."""
    from jax_ub.bench import harness

    recs = [
        _span(0, 1, "copy", 1, "comm0", 0.0, 0.2, 0.0),
        _span(0, 2, "gemm", 0, "compute0", 0.0, 0.4, 1.0),
    ]
    monkeypatch.setattr(harness, "capture_timeline", lambda fn, args: (recs, ""))
    a = _args(remat=["none"])
    s = layer.Shape(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128, seq=32, batch=2, tp=4)
    stem = str(tmp_path / "x-layer")
    line = layer.write_trace(a, s, stem, (None, ()), True, "path: cuda")
    assert line == f"trace: {stem}-trace.json: 2 op spans, 2 chunk spans"
    doc = json.loads(Path(f"{stem}-trace.json").read_text())
    assert doc == json.loads(json.dumps(timeline.chrome_trace(recs, title=doc["otherData"]["title"])))
    one = layer.Shape(hidden=64, heads=8, kv_heads=4, head_dim=16, ffn=128, seq=32, batch=2, tp=1)
    assert "at tp=1 the step runs no jax_ub op" in layer.write_trace(a, one, stem, (None, ()), True, "")
    assert "XLA reference path" in layer.write_trace(a, s, stem, (None, ()), False, "")
    doc = json.loads(Path(f"{stem}-trace.json").read_text())
    assert [e for e in doc["traceEvents"] if e["ph"] == "X"] == [] and "reference" in doc["otherData"]["note"]
