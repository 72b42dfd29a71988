"""``python -m jax_ub.doctor``: the real report on this machine, and simulated GPU machines (the
gathering functions replaced by fakes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jax_ub
from jax_ub import doctor

REPO = Path(__file__).resolve().parents[2]


def _has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


cpu_only = pytest.mark.skipif(_has_cuda(), reason="checks the report of a machine without CUDA GPUs")


# ------------------------------------------------------------------------------------------------
# the real report on this (CPU) machine


@cpu_only
def test_text_report_on_this_machine(capsys, monkeypatch):
    monkeypatch.delenv("JAX_UB_MULTICAST", raising=False)
    rc = doctor.main(["--no-live"])
    out = capsys.readouterr().out
    assert rc == 1
    for section in (
        "== Versions ==",
        "== GPUs ==",
        "== P2P and topology ==",
        "== Decision",
        "== Live all-gather test ==",
    ):
        assert section in out
    assert f"jax / jaxlib  {jax.__version__} / " in out
    assert f"jax_ub        {jax_ub.__version__}" in out
    assert "no CUDA GPU (backend: cpu)" in out
    assert "skipped (--no-live)" in out
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in out and "XLA_PYTHON_CLIENT_MEM_FRACTION" in out
    assert "multicast   none (no multicast path" in out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("CANNOT RUN OVERLAP: ")
    assert "no CUDA GPU (jax backend: cpu" in last


@cpu_only
def test_json_report_on_this_machine(capsys):
    rc = doctor.main(["--json", "--no-live"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert set(r) == {"versions", "gpus", "p2p", "topology", "config", "decision", "live", "verdict"}
    assert r["versions"]["jax"] == jax.__version__
    assert r["versions"]["jax_ub"] == jax_ub.__version__
    assert r["gpus"]["devices"] == [] and r["gpus"]["backend"] == "cpu"
    assert r["live"] == {"ran": False, "ok": None, "skipped": "skipped (--no-live)"}
    assert r["decision"]["bootstrap"] == "local" and r["decision"]["transport"] is None
    assert r["verdict"]["ok"] is False and r["verdict"]["exit_code"] == 1
    assert any(reason.startswith("no CUDA GPU") for reason in r["verdict"]["reasons"])
    assert r["verdict"]["message"].startswith("CANNOT RUN OVERLAP: ")
    assert r["config"]["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")


def test_nccl_version_of_the_wheel():
    paths = doctor._ext.find_libraries()["nccl"]
    if not paths:
        pytest.skip("no nvidia-nccl wheel on sys.path")
    v = doctor.nccl_version(paths[0])
    assert v["error"] is None, v
    assert v["version"] == doctor.nccl_version_string(v["code"])
    assert v["version"].startswith("2.") and v["code"] >= 20000


def test_nccl_version_decoding_and_failure():
    assert doctor.nccl_version_string(22105) == "2.21.5"
    assert doctor.nccl_version_string(23203) == "2.32.3"
    assert doctor.nccl_version_string(2708) == "2.7.8"  # before 2.9: major*1000 + minor*100 + patch
    bad = doctor.nccl_version("/nonexistent/libnccl.so.2")
    assert bad["version"] is None and "cannot load /nonexistent/libnccl.so.2" in bad["error"]
    assert "not found" in doctor.nccl_version(None)["error"]


@cpu_only
def test_cli_subprocess():
    r = subprocess.run(
        [sys.executable, "-m", "jax_ub.doctor", "--no-live"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
        check=False,
    )
    assert r.returncode == 1, r.stderr
    assert "== Versions ==" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("CANNOT RUN OVERLAP: ")
    assert "no CUDA GPU" in r.stdout.rstrip().splitlines()[-1]


def test_cli_bad_usage_exits_2():
    r = subprocess.run(
        [sys.executable, "-m", "jax_ub.doctor", "--bogus"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
        check=False,
    )
    assert r.returncode == 2
    assert "unrecognized arguments: --bogus" in r.stderr


def test_import_touches_no_backend():
    code = (
        "import jax_ub.doctor\nfrom jax._src import xla_bridge\n"
        "print(len(getattr(xla_bridge, '_backends', {})))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


# ------------------------------------------------------------------------------------------------
# simulated machines


def _versions(built=True, loaded=True, missing=()):
    return {
        "python": "3.11.7",
        "python_executable": "/usr/bin/python3",
        "jax": "0.10.2",
        "jaxlib": "0.10.2",
        "jax_ub": "0.1.0",
        "extension": {
            "built": built,
            "build_reason": None if built else "nvcc not found on PATH",
            "build_facts": {"cuda_built": built, "nvcc_version": "12.8", "cuda_archs": "80;90a"},
            "loaded": loaded,
            "load_error": None if loaded else "libcudart.so.12: not found",
            "file": "/site/_jax_ub_cuda.so",
            "build_info": {"cuda_runtime_version": 12080},
            "missing_functions": list(missing),
        },
        "cuda": {"driver_version": 12040, "driver": "12.4", "device_count": 4, "error": None},
        "cublaslt": {"paths": ["/site/libcublasLt.so.12"], "description": "cuBLASLt 120800 from /site/x"},
        "nccl": {
            "path": "/site/libnccl.so.2",
            "paths": ["/site/libnccl.so.2"],
            "code": 22105,
            "version": "2.21.5",
            "error": None,
        },
    }


def _gpus(n=4, process_count=1):
    devs = [
        {
            "id": i,
            "device_kind": "NVIDIA H100 80GB HBM3",
            "process_index": 0,
            "local_hardware_id": i,
            "memory_free": 20 << 30,
            "memory_total": 80 << 30,
        }
        for i in range(n)
    ]
    return {
        "backend": "gpu",
        "devices": devs,
        "local_ids": list(range(n)),
        "error": None,
        "process_index": 0,
        "process_count": process_count,
        "distributed": process_count > 1,
    }


def _matrix(n=4, missing=()):
    m = [[1] * n for _ in range(n)]
    for i, j in missing:
        m[i][j] = m[j][i] = 0
    return m


TOPO = "\tGPU0\tGPU1\tGPU2\tGPU3\nGPU0\t X \tNV18\tNV18\tNV18"


class LiveSpy:
    def __init__(self, ok=True, error=None):
        self.calls = []
        self.ok, self.error = ok, error

    def __call__(self, ids, *a, **kw):
        self.calls.append(list(ids))
        if not self.ok:
            return {"ran": True, "ok": False, "devices": list(ids), "error": self.error}
        return {
            "ran": True,
            "ok": True,
            "devices": list(ids),
            "error": None,
            "shape": [len(ids) * 256, 1024],
            "dtype": "bfloat16",
            "median_ms": 0.05,
            "bytes": len(ids) * 524288,
            "algbw_gbps": 42.0,
            "busbw_gbps": 31.5,
        }


@pytest.fixture
def machine(monkeypatch):
    """``machine(n=4, missing_p2p=(), ...)`` installs fakes for every gatherer; returns the live spy."""
    for k in list(os.environ):
        if k.startswith("JAX_UB_") or k in doctor.ENV_VARS:
            monkeypatch.delenv(k)

    def install(n=4, missing_p2p=(), versions=None, process_count=1, live=None, matrix=None):
        spy = live or LiveSpy()
        monkeypatch.setattr(doctor, "gather_versions", lambda: versions or _versions())
        monkeypatch.setattr(doctor, "gather_gpus", lambda: _gpus(n, process_count))
        m = matrix if matrix is not None else _matrix(n, missing_p2p)
        monkeypatch.setattr(doctor, "gather_p2p", lambda: {"matrix": m, "error": None})
        monkeypatch.setattr(
            doctor,
            "gather_topology",
            lambda: {"nvidia_smi": "/usr/bin/nvidia-smi", "output": TOPO, "error": None},
        )
        monkeypatch.setattr(doctor, "run_live_test", spy)
        monkeypatch.setattr(doctor, "run_live_test_bounded", spy)
        return spy

    return install


def _run(capsys, *args):
    rc = doctor.main(list(args))
    out = capsys.readouterr().out
    return rc, out, out.rstrip().splitlines()[-1]


def test_four_gpus_full_p2p_ok(machine, capsys):
    live = machine(4)
    rc, out, last = _run(capsys)
    assert rc == 0
    assert last == "OK: overlap can run (transport ipc, 4 GPUs)"
    assert live.calls == [[0, 1, 2, 3]]
    assert "bootstrap   local: one process drives all 4 local GPUs" in out
    assert "transport   ipc: every pair of the 4 local GPUs can access each other (P2P)" in out
    assert "id 3: NVIDIA H100 80GB HBM3 (process 0, local_hardware_id 3, 20.0 GiB free of 80.0 GiB)" in out
    assert "NV18" in out  # nvidia-smi topo -m
    assert "busbw 31.5 GB/s" in out and "equal to the input" in out
    assert "CUDA driver   12.4; devices: 4" in out and "NCCL          2.21.5 (code 22105)" in out
    assert " NO" not in out  # no P2P hole in the table


def test_four_gpus_full_p2p_json(machine, capsys):
    machine(4)
    rc, out, _ = _run(capsys, "--json")
    r = json.loads(out)
    assert rc == 0 and r["verdict"]["ok"] is True and r["verdict"]["exit_code"] == 0
    assert r["decision"]["transport"] == "ipc" and r["decision"]["bootstrap"] == "local"
    assert r["decision"]["no_p2p_pairs"] == []
    assert r["live"]["ok"] is True and r["live"]["devices"] == [0, 1, 2, 3]


def test_extension_view_of_nccl(machine, capsys):
    v = _versions()
    v["nccl"]["extension_view"] = {"version": None, "library": None, "load_error": "dlopen failed: nope"}
    machine(4, versions=v)
    _, out, _ = _run(capsys, "--no-live")
    assert "the extension cannot load NCCL: dlopen failed: nope" in out
    v["nccl"]["extension_view"] = {"version": "2.21.5", "library": "/site/libnccl.so.2", "load_error": None}
    _, out, _ = _run(capsys, "--no-live")
    assert "the extension loads NCCL 2.21.5 from /site/libnccl.so.2" in out


def test_no_live_skips_the_live_test(machine, capsys):
    live = machine(4)
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 0 and last == "OK: overlap can run (transport ipc, 4 GPUs)"
    assert live.calls == []
    assert "skipped (--no-live)" in out


def test_gpu0_and_gpu2_without_p2p_transport_nccl(machine, capsys, monkeypatch):
    monkeypatch.setattr(doctor, "nccl_transport_implemented", lambda: True)
    live = machine(4, missing_p2p=[(0, 2)])
    rc, out, last = _run(capsys)
    assert rc == 0
    assert "GPU 0 and GPU 2 cannot access each other: transport nccl" in out
    assert "transport   nccl: GPU 0 and GPU 2 cannot access each other: transport nccl" in out
    assert last == "OK: overlap can run (transport nccl, 4 GPUs)"
    assert "note: GPU 0 and GPU 2 cannot access each other: transport nccl" in out
    assert live.calls == [[0, 1, 2, 3]]
    table = [ln for ln in out.splitlines() if ln.strip().startswith("GPU0 ")]
    assert len(table) == 2 and table[1].split() == ["GPU0", "-", "yes", "NO", "yes"]


def test_this_version_implements_the_nccl_transport():
    assert doctor.nccl_transport_implemented() is True


def test_no_p2p_pair_without_nccl_transport_tests_a_p2p_group(machine, capsys, monkeypatch):
    # a build without the NCCL transport: still not fatal, but TP groups must be P2P cliques
    monkeypatch.setattr(doctor, "nccl_transport_implemented", lambda: False)
    live = machine(4, missing_p2p=[(0, 2)])
    rc, out, _ = _run(capsys, "--json")
    r = json.loads(out)
    assert rc == 0 and r["verdict"]["message"] == "OK: overlap can run (transport nccl, 4 GPUs)"
    assert r["decision"]["transport"] == "nccl"
    assert r["decision"]["transport_reason"] == "GPU 0 and GPU 2 cannot access each other: transport nccl"
    assert r["decision"]["no_p2p_pairs"] == [[0, 2]]
    assert r["decision"]["p2p_group"] == [0, 1, 3]
    assert live.calls == [[0, 1, 3]]
    assert any("only the ipc transport" in n for n in r["verdict"]["notes"])
    assert any("live test ran on GPUs [0, 1, 3] only" in n for n in r["verdict"]["notes"])


def test_one_way_p2p_counts_as_no_p2p(machine, capsys):
    m = _matrix(2)
    m[1][0] = 0
    machine(2, matrix=m)
    rc, out, _ = _run(capsys, "--no-live")
    assert rc == 0
    assert "GPU 0 and GPU 1 cannot access each other: transport nccl" in out


def test_live_test_failure(machine, capsys):
    machine(4, live=LiveSpy(ok=False, error="RuntimeError: peer 2 did not answer"))
    rc, out, last = _run(capsys)
    assert rc == 1
    assert last == "CANNOT RUN OVERLAP: live test failed: RuntimeError: peer 2 did not answer"
    assert "FAILED on GPUs [0, 1, 2, 3]: RuntimeError: peer 2 did not answer" in out


def test_one_gpu(machine, capsys):
    live = machine(1)
    rc, out, last = _run(capsys)
    assert rc == 1 and live.calls == []
    assert last == "CANNOT RUN OVERLAP: fewer than 2 GPUs: only 1 CUDA GPU, TP overlap needs at least 2"
    assert "skipped: overlap cannot run here" in out


def test_extension_not_built_says_why(machine, capsys):
    live = machine(4, versions=_versions(built=False, loaded=False))
    rc, out, last = _run(capsys)
    assert rc == 1 and live.calls == []
    assert last == "CANNOT RUN OVERLAP: the CUDA extension is not built: nvcc not found on PATH"
    assert "extension     NOT BUILT: nvcc not found on PATH" in out


def test_extension_cannot_load(machine, capsys):
    machine(4, versions=_versions(loaded=False))
    rc, _, last = _run(capsys)
    assert rc == 1
    assert last == "CANNOT RUN OVERLAP: the CUDA extension cannot be loaded: libcudart.so.12: not found"


def test_stale_extension(machine, capsys):
    machine(4, versions=_versions(missing=["comm_create", "p2p_matrix"]))
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 1
    assert "older build: lacks comm_create, p2p_matrix" in out
    assert "lacks comm_create, p2p_matrix; rebuild it with `pip install .`" in last


def test_multi_process_uses_kv_bootstrap(machine, capsys):
    live = machine(4, process_count=4)
    rc, out, _ = _run(capsys)
    assert "bootstrap   kv: jax.distributed is initialized with 4 processes" in out
    assert "skipped: jax.distributed has several processes" in out
    assert live.calls == [] and rc == 0


def test_environment_and_multicast(machine, capsys, monkeypatch):
    machine(4)
    monkeypatch.setenv("JAX_UB_TIMEOUT", "33")
    monkeypatch.setenv("JAX_UB_ON_STALL", "wait")
    monkeypatch.setenv("JAX_UB_MULTICAST", "1")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    rc, out, _ = _run(capsys, "--no-live")
    assert rc == 0
    lines = {
        ln.split()[0]: ln.split()[1]
        for ln in out.splitlines()
        if ln.startswith("    ") and len(ln.split()) == 2
    }
    assert lines["JAX_UB_TIMEOUT"] == "33" and lines["JAX_UB_MULTICAST"] == "1"
    assert lines["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and lines["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert "NCCL_NVLS_ENABLE                (unset)" in out
    assert "timeout_s=33 on_stall=wait" in out
    assert "multicast   none: JAX_UB_MULTICAST=1 does nothing" in out
    monkeypatch.setenv("UB_SKIPMC", "1")
    _run(capsys, "--no-live")
    r = doctor.gather_config()
    assert r["multicast"] == {
        "enabled": False,
        "reason": "none: JAX_UB_MULTICAST=1 and UB_SKIPMC=1 do "
        "nothing (no multicast path; the variables will be removed)",
    }


def test_invalid_configuration_is_fatal(machine, capsys, monkeypatch):
    live = machine(4)
    monkeypatch.setenv("JAX_UB_METHOD", "bogus")
    rc, out, last = _run(capsys)
    assert rc == 1 and live.calls == []
    assert "config      INVALID: JAX_UB_METHOD must be one of" in out
    assert last.startswith("CANNOT RUN OVERLAP: invalid jax_ub configuration: JAX_UB_METHOD must be one of")


def test_tuning_file_is_read_and_a_bad_one_is_fatal(machine, capsys, monkeypatch, tmp_path):
    """JAX_UB_TUNING_FILE: the doctor reads it as auto would; one auto cannot read would fail the
    first traced op, so it is a blocking reason, named with choice's error."""
    machine(4)
    good = tmp_path / "tune.json"
    good.write_text(
        json.dumps(
            {
                "machine": "m",
                "date": "d",
                "records": [
                    {
                        "op": op,
                        "tp": 4,
                        "dtype": "bfloat16",
                        "M": 64,
                        "K": 32,
                        "N": 96,
                        "impl": impl,
                        "ms": ms,
                    }
                    for op, methods in (("ag_gemm", ("push", "ring")), ("gemm_rs", ("ring", "chain")))
                    for impl, ms in (
                        (f"jax_ub_{methods[0]}", 1.0),
                        (f"jax_ub_{methods[1]}", 2.0),
                        ("xla_plain", 3.0),
                    )
                ],
            }
        )
    )
    monkeypatch.setenv("JAX_UB_TUNING_FILE", str(good))
    rc, out, _ = _run(capsys, "--no-live")
    assert rc == 0
    assert f"tuning      {good}: 2 measured shapes (ag tp4, rs tp4), auto chooses from them first" in out
    bad = tmp_path / "bad.json"
    bad.write_text('{"records": []}')
    monkeypatch.setenv("JAX_UB_TUNING_FILE", str(bad))
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 1 and f"tuning      {bad}: UNUSABLE: JAX_UB_TUNING_FILE" in out
    assert last.startswith(f"CANNOT RUN OVERLAP: invalid tuning file: JAX_UB_TUNING_FILE '{bad}' has no")


def test_disable_is_fatal(machine, capsys, monkeypatch):
    machine(4)
    monkeypatch.setenv("JAX_UB_DISABLE", "1")
    rc, _, last = _run(capsys, "--no-live")
    assert rc == 1 and last == "CANNOT RUN OVERLAP: JAX_UB_DISABLE=1 forces the pure-XLA reference path"


def test_forced_nccl_transport_is_chosen(machine, capsys, monkeypatch):
    machine(4)
    monkeypatch.setenv("JAX_UB_TRANSPORT", "nccl")
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 0, out
    assert "transport   nccl: forced by JAX_UB_TRANSPORT=nccl" in out
    assert last == "OK: overlap can run (transport nccl, 4 GPUs)"


def test_forced_nccl_transport_is_not_available_in_builds_without_it(machine, capsys, monkeypatch):
    machine(4)
    monkeypatch.setattr(doctor, "nccl_transport_implemented", lambda: False)
    monkeypatch.setenv("JAX_UB_TRANSPORT", "nccl")
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 1
    assert "transport   nccl: forced by JAX_UB_TRANSPORT=nccl" in out
    assert "the NCCL transport (forced by JAX_UB_TRANSPORT=nccl) is not available" in last


# ------------------------------------------------------------------------------------------------
# the pieces


def test_topology_absent_timeout_and_output(monkeypatch):
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor.gather_topology() == {
        "nvidia_smi": None,
        "output": None,
        "error": "nvidia-smi not found on PATH",
    }
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    seen = {}

    def ok(cmd, **kw):
        seen.update(cmd=cmd, timeout=kw.get("timeout"))
        return subprocess.CompletedProcess(cmd, 0, stdout=TOPO + "\n", stderr="")

    monkeypatch.setattr(doctor.subprocess, "run", ok)
    assert doctor.gather_topology()["output"] == TOPO
    assert seen == {"cmd": ["/usr/bin/nvidia-smi", "topo", "-m"], "timeout": 10}

    def hang(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(doctor.subprocess, "run", hang)
    t = doctor.gather_topology()
    assert t["output"] is None and "did not finish within 10 s" in t["error"]


def test_p2p_helpers():
    m = _matrix(4, [(0, 2), (1, 3)])
    assert doctor.no_p2p_pairs(m, [0, 1, 2, 3]) == [(0, 2), (1, 3)]
    assert doctor.no_p2p_pairs(m, [0, 1]) == []
    assert doctor.p2p_group(m, [0, 1, 2, 3]) == [0, 1]
    assert doctor.no_p2p_pairs(_matrix(2), [0, 5]) == [(0, 5)]  # ordinal outside the matrix


def test_live_test_reports_the_op_error_and_shuts_down(monkeypatch):
    # on CPU the real jax_ub.initialize is a no-op (no communicators): the first op's error is
    # reported, shutdown still runs
    calls = []
    real_shutdown = jax_ub.shutdown
    monkeypatch.setattr(jax_ub, "shutdown", lambda *a: calls.append(a) or real_shutdown(*a))
    r = doctor.run_live_test([0, 1], platform="cpu")
    assert r["ran"] is True and r["ok"] is False
    assert any(
        why in r["error"]
        for why in (
            "jax_ub CUDA extension unavailable",  # not built
            "no jax_ub communicator for mesh axis 'tp'",
            "created no communicator for mesh axis 'tp'",
        )
    ), r["error"]
    assert calls == [()]


def _fake_all_gather(x, axis_name):
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)


def test_live_test_checks_and_times_on_cpu(monkeypatch):
    inits, shutdowns = [], []
    monkeypatch.setattr(jax_ub, "initialize", lambda mesh, axis: inits.append((mesh.shape, axis)))
    monkeypatch.setattr(jax_ub, "shutdown", lambda *a: shutdowns.append(a))
    monkeypatch.setattr(jax_ub.overlap, "all_gather", _fake_all_gather)
    r = doctor.run_live_test([0, 1, 2, 3], platform="cpu", repeats=2, warmup=1)
    assert r["ok"] is True, r
    assert inits == [({"tp": 4}, "tp")] and shutdowns == [()]
    assert r["shape"] == [4 * 256, 1024] and r["bytes"] == 4 * 256 * 1024 * 2
    assert r["median_ms"] > 0 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 3 / 4)


def test_live_test_detects_wrong_data(monkeypatch):
    monkeypatch.setattr(jax_ub, "initialize", lambda mesh, axis: None)
    monkeypatch.setattr(jax_ub, "shutdown", lambda *a: None)
    monkeypatch.setattr(jax_ub.overlap, "all_gather", lambda x, a: _fake_all_gather(x, a) * 2)
    r = doctor.run_live_test([0, 1], platform="cpu", repeats=1, warmup=1)
    assert r["ok"] is False
    assert "AssertionError: all_gather on device" in r["error"] and "differs from its input" in r["error"]


def test_live_test_shutdown_failure_fails_the_test(monkeypatch):
    monkeypatch.setattr(jax_ub, "initialize", lambda mesh, axis: None)
    monkeypatch.setattr(jax_ub.overlap, "all_gather", _fake_all_gather)

    def bad_shutdown(*a):
        raise RuntimeError("drain timed out")

    monkeypatch.setattr(jax_ub, "shutdown", bad_shutdown)
    r = doctor.run_live_test([0, 1], platform="cpu", repeats=1, warmup=1)
    assert r["ok"] is False and r["error"] == "shutdown: RuntimeError: drain timed out"


def test_multi_line_reasons_are_indented_under_their_value(machine, capsys):
    """A library's load error lists what it tried on lines of its own: those lines stay inside the
    field (indented to the value's column), not flush with the section's labels."""
    v = _versions()
    v["cublaslt"] = {
        "paths": [],
        "description": "could not load cuBLASLt (libcublasLt.so); tried:\n"
        "  libcublasLt.so.13: cannot open shared object file\n(install jax with its CUDA extra)",
    }
    v["nccl"] = {
        "path": None,
        "paths": [],
        "code": None,
        "version": None,
        "error": "not found; tried:\n  libnccl.so.2: cannot open",
        "extension_view": {
            "version": None,
            "library": None,
            "load_error": "could not load NCCL; tried:\n  libnccl.so.2: nope",
        },
    }
    machine(4, versions=v)
    _, out, _ = _run(capsys, "--no-live")
    lines = out.splitlines()
    i = lines.index("  cuBLASLt      could not load cuBLASLt (libcublasLt.so); tried:")
    assert lines[i + 1 : i + 3] == [
        "                  libcublasLt.so.13: cannot open shared object file",
        "                (install jax with its CUDA extra)",
    ], lines[i : i + 3]
    i = lines.index("  NCCL          unavailable: not found; tried:")
    assert lines[i + 1 : i + 4] == [
        "                  libnccl.so.2: cannot open",
        "                the extension cannot load NCCL: could not load NCCL; tried:",
        "                    libnccl.so.2: nope",
    ], lines[i : i + 4]
    assert doctor._indent_continuations("CANNOT RUN OVERLAP: a\nb") == "CANNOT RUN OVERLAP: a\n  b"
    assert doctor._indent_continuations("  one line") == "  one line"


def test_the_live_test_is_called_as_the_docs_call_it(machine, capsys):
    """docs/failures.md calls it "the live all-gather test" (``--no-live``); the report's section
    says so."""
    docs = (REPO / "docs" / "failures.md").read_text()
    assert "live all-gather test" in docs
    machine(4)
    _, out, _ = _run(capsys)
    assert "== Live all-gather test ==" in out and "ring test" not in out.lower()


# ------------------------------------------------------------------------------------------------
# Stale sources, forced ipc without P2P, jax without its CUDA backend, the bounded
# live test, unknown JAX_UB_* variables


class _FakeExtension:
    __file__ = "/site/_jax_ub_cuda.so"

    def __init__(self, source_hash):
        self.source_hash = source_hash

    def build_info(self):
        return {"cuda_runtime_version": 12080} | (
            {"source_hash": self.source_hash} if self.source_hash else {}
        )


def _checkout(tmp_path, text="int x;\n"):
    csrc = tmp_path / "co" / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "_jax_ub_build.py.in").write_text("")
    (csrc / "module.cc").write_text(text)
    return str(csrc)


def test_extension_built_from_other_sources_is_fatal(machine, capsys, monkeypatch, tmp_path):
    """An extension whose recorded source hash is not the checkout's csrc/ (e.g. built before a
    handler gained an attribute) is a blocking reason that says how to rebuild."""
    csrc = _checkout(tmp_path)
    monkeypatch.setattr(doctor._ext, "checkout_csrc", lambda *a: csrc)
    v = _versions()
    v["extension"]["source"] = doctor.gather_source(_FakeExtension("0" * 64))
    machine(4, versions=v)
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 1, out
    assert last.startswith(
        "CANNOT RUN OVERLAP: the CUDA extension /site/_jax_ub_cuda.so was not built "
        f"from this checkout's {csrc} (expected sources "
    )
    assert "built from sources 000000000000" in last and "`pip install .` in " in last
    assert "sources       OTHER THAN THIS CHECKOUT'S" in out
    # an extension that records no hash at all predates the check: stale too
    v["extension"]["source"] = doctor.gather_source(_FakeExtension(None))
    rc, _, last = _run(capsys, "--no-live")
    assert rc == 1 and "it records no source hash" in last
    # the same sources: fine, and the report says they match
    v["extension"]["source"] = doctor.gather_source(_FakeExtension(doctor._ext.source_hash(csrc)))
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 0 and last.startswith("OK: ")
    assert f": those of this checkout ({csrc})" in out


def test_installed_package_without_csrc_is_not_compared(machine, capsys, monkeypatch):
    monkeypatch.setattr(doctor._ext, "checkout_csrc", lambda *a: None)
    v = _versions()
    v["extension"]["source"] = src = doctor.gather_source(_FakeExtension("0" * 64))
    assert src["stale"] is None and src["checkout"] is None
    machine(4, versions=v)
    rc, out, _ = _run(capsys, "--no-live")
    assert rc == 0 and "(no checkout to compare with: an installed package)" in out


def test_forced_ipc_without_p2p_is_fatal_as_initialize_would_raise(machine, capsys, monkeypatch):
    """JAX_UB_TRANSPORT=ipc where two GPUs cannot access each other: initialize raises, so the
    doctor must not say OK (with or without the live test), and says what initialize says."""
    import types

    from jax_ub import comm

    live = machine(4, missing_p2p=[(0, 2)])
    monkeypatch.setenv("JAX_UB_TRANSPORT", "ipc")
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 1, out
    devs = [types.SimpleNamespace(id=i, process_index=0) for i in range(4)]
    with pytest.raises(ValueError) as e:
        comm._choose_transport("ipc", [devs], ["host"], [(devs[0], devs[2])])
    assert last == f"CANNOT RUN OVERLAP: {e.value} (JAX_UB_TRANSPORT=ipc forces ipc: unset it)"
    r = json.loads(_run(capsys, "--json")[1])
    assert r["decision"]["no_p2p_pairs"] == [[0, 2]] and r["verdict"]["exit_code"] == 1
    assert live.calls == []
    machine(4)  # every pair can: forcing ipc is fine
    rc, _, last = _run(capsys, "--no-live")
    assert rc == 0 and last == "OK: overlap can run (transport ipc, 4 GPUs)"


def _no_jax_gpu(monkeypatch, error):
    gpus = _gpus(0)
    gpus.update(backend="cpu", error=error)
    monkeypatch.setattr(doctor, "gather_gpus", lambda: gpus)


@pytest.mark.parametrize(("driver", "extra"), [(13000, "cuda13"), (12040, "cuda12")])
def test_jax_without_its_cuda_backend_on_a_gpu_machine(machine, capsys, monkeypatch, driver, extra):
    """The CUDA runtime counts GPUs but jax has no CUDA backend (plain `pip install jax`): the
    verdict says so and names the extra that matches the driver; the GPUs section shows jax's error."""
    v = _versions()
    v["cuda"].update(driver_version=driver, driver=f"{driver // 1000}.{driver % 1000 // 10}")
    machine(4, versions=v)
    _no_jax_gpu(monkeypatch, "RuntimeError: Unknown backend cuda. Available backends are ['cpu']")
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 1
    assert "jax has no CUDA backend: RuntimeError: Unknown backend cuda" in last
    assert "the CUDA runtime counts 4 GPU(s)" in last
    assert f'`pip install -U "jax[{extra}]"`' in last and f'`".[{extra}]"`' in last
    assert "  jax: RuntimeError: Unknown backend cuda. Available backends are ['cpu']" in out


def test_no_driver_is_named_as_such(machine, capsys, monkeypatch):
    v = _versions()
    v["cuda"] = {
        "driver_version": None,
        "driver": None,
        "device_count": 0,
        "error": "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
        "libcuda_error": "libcuda.so.1: cannot open shared object file: No such file or directory",
    }
    machine(4, versions=v)
    _no_jax_gpu(monkeypatch, "RuntimeError: Unknown backend cuda")
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 1
    assert (
        "  CUDA driver   none: libcuda.so.1 cannot be loaded (libcuda.so.1: cannot open shared object "
        "file: No such file or directory); devices: 0 (cudaErrorInsufficientDriver"
    ) in out
    assert last == (
        "CANNOT RUN OVERLAP: no CUDA GPU (jax backend: cpu): no NVIDIA driver found (libcuda.so.1 "
        "cannot be loaded: libcuda.so.1: cannot open shared object file: No such file or "
        "directory); the CUDA path needs NVIDIA GPUs and their driver"
    )
    v["cuda"]["libcuda_error"] = None  # a driver that is there but too old: the runtime's words
    rc, out, last = _run(capsys, "--no-live")
    assert "  CUDA driver   unavailable; devices: 0 (cudaErrorInsufficientDriver" in out
    assert last == (
        "CANNOT RUN OVERLAP: no CUDA GPU (jax backend: cpu; CUDA runtime: "
        "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version)"
    )


def test_libcuda_error_on_this_machine():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        assert doctor.libcuda_error() == str(e)
    else:
        assert doctor.libcuda_error() is None


def _child(monkeypatch, code):
    monkeypatch.setattr(doctor, "_live_child_command", lambda ids, platform: [sys.executable, "-c", code])


def test_live_test_runs_in_a_child_with_a_bounded_timeout():
    """The live test's process waits at most LIVE_TIMEOUT_S for a peer, whatever JAX_UB_TIMEOUT
    says (3600 here); on this CPU machine its jax_ub.overlap.all_gather fails and says why."""
    r = doctor.run_live_test_bounded([0, 1], timeout_s=3600, platform="cpu")
    assert r["ran"] is True and r["ok"] is False and r["devices"] == [0, 1]
    assert r["timeout_s"] == doctor.LIVE_TIMEOUT_S == 30  # as the child's own config read it
    assert any(
        why in r["error"]
        for why in ("jax_ub CUDA extension unavailable", "no jax_ub communicator for mesh axis 'tp'")
    ), r["error"]
    assert 0 < doctor.LIVE_WALL_S <= 600


def test_live_test_child_environment(monkeypatch):
    monkeypatch.setenv("JAX_UB_TIMEOUT", "3600")
    mark = doctor.LIVE_RESULT_MARK
    _child(
        monkeypatch,
        "import json, os; print('noise'); print(" + repr(mark) + " + json.dumps({'ok': True, "
        "'seen': [os.environ['JAX_UB_TIMEOUT'], os.environ['XLA_PYTHON_CLIENT_PREALLOCATE']]}))",
    )
    r = doctor.run_live_test_bounded([0, 1], timeout_s=3600)
    assert r["ok"] is True and r["seen"] == ["30", "false"], r
    r = doctor.run_live_test_bounded([0, 1], timeout_s=5)
    assert r["seen"] == ["5", "false"]


def test_live_test_abort_or_hang_is_a_failed_test_not_the_doctors_end(machine, capsys, monkeypatch):
    """JAX_UB_ON_STALL=abort (the default) kills the process at a stall: the live test's process,
    not the doctor, which still prints its verdict (and its JSON); a hang is killed after wall_s."""
    _child(
        monkeypatch,
        "import os, sys; sys.stderr.write('jax_ub: stall on GPU 1\\n'); sys.stderr.flush(); os.abort()",
    )
    r = doctor.run_live_test_bounded([0, 1], timeout_s=120)
    assert r["ok"] is False
    assert r["error"].startswith("the live test's process was ended by SIGABRT before reporting a result")
    assert r["error"].endswith("its last output:\njax_ub: stall on GPU 1")
    _child(monkeypatch, "import sys, time; print('compiling', file=sys.stderr, flush=True); time.sleep(60)")
    r = doctor.run_live_test_bounded([0, 1], timeout_s=120, wall_s=2)
    assert r["ok"] is False and r["error"].startswith(
        "the live test's process did not finish within 2 s (waits for a peer bounded at 30 s) and was killed"
    )
    assert r["error"].endswith("compiling")
    # through the doctor: its own process survives and reports
    _child(monkeypatch, "import os; os.abort()")
    real = doctor.run_live_test_bounded
    machine(4)
    monkeypatch.setattr(doctor, "run_live_test_bounded", real)
    rc, out, _ = _run(capsys, "--json")
    r = json.loads(out)
    assert rc == 1 and r["verdict"]["message"] == (
        "CANNOT RUN OVERLAP: live test failed: the live test's "
        "process was ended by SIGABRT before reporting a result"
    )


def test_unknown_jax_ub_variables_are_in_the_report(machine, capsys, monkeypatch):
    """A misspelt knob changes nothing: the report (text and JSON) names it, with the knob it most
    likely means, so a pasted report keeps it. It is not a blocking reason."""
    machine(4)
    monkeypatch.setenv("JAX_UB_METHD", "xla")
    monkeypatch.setenv("JAX_UB_ZZZZ", "1")
    monkeypatch.setenv("JAX_UB_TIMEOUT", "60")
    rc, out, last = _run(capsys, "--no-live")
    assert rc == 0 and last.startswith("OK: ")
    assert (
        "note: JAX_UB_METHD=xla is not a jax_ub setting: it is ignored (did you mean JAX_UB_METHOD?)" in out
    )
    assert "note: JAX_UB_ZZZZ=1 is not a jax_ub setting: it is ignored\n" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("JAX_UB_METHD"))
    assert line.split()[1] == "xla" and "not a jax_ub setting: ignored (did you mean JAX_UB_METHOD?)" in line
    assert "<-" not in next(ln for ln in out.splitlines() if ln.strip().startswith("JAX_UB_TIMEOUT"))
    r = json.loads(_run(capsys, "--json", "--no-live")[1])
    assert r["config"]["unknown_variables"] == [
        {"name": "JAX_UB_METHD", "value": "xla", "did_you_mean": "JAX_UB_METHOD"},
        {"name": "JAX_UB_ZZZZ", "value": "1", "did_you_mean": None},
    ]
    assert any("JAX_UB_METHD=xla" in n for n in r["verdict"]["notes"])
