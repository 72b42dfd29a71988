"""``python -m jax_ub.doctor [--json] [--no-live]``: can jax_ub's overlap run on this machine, and if
not, why not.

It gathers, section by section (each a function returning a plain dict, so tests can replace it):

1. versions: python, jax, jaxlib, jax_ub, the extension (built? loaded? how was it compiled?), the
   CUDA driver and device count as the CUDA runtime sees them, cuBLASLt and NCCL (the libraries of
   jax's ``nvidia-*`` wheels that the extension loads at run time);
2. the CUDA GPUs of jax (and how many processes jax.distributed has);
3. the peer-access (P2P) matrix and ``nvidia-smi topo -m``;
4. the decision ``jax_ub.initialize`` takes here: bootstrap (``local`` / ``kv``), transport
   (``ipc`` when every GPU pair can access each other, else ``nccl``), multicast, and the
   environment variables that matter;
5. a live all-gather test: ``jax_ub.overlap.all_gather`` over every local GPU, checked bit for bit and
   timed (``--no-live`` skips it), in a child process bounded in time (``LIVE_TIMEOUT_S`` per wait,
   ``LIVE_WALL_S`` in all), so that a stall (``JAX_UB_ON_STALL=abort``) or a hang becomes a failed
   test in the report instead of ending or blocking the doctor;
6. a verdict: ``OK: overlap can run (...)`` (exit 0) or ``CANNOT RUN OVERLAP: <reasons>`` (exit 1).

``--json`` prints one JSON object with the same facts instead of the text report. Nothing here
touches a GPU at import time and nothing is written to disk.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from jax_ub import _ext, config

# Environment variables that change what jax_ub or XLA do on a GPU machine (every JAX_UB_* set is
# reported as well).
ENV_VARS = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_NVLS_ENABLE",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "CUDA_VISIBLE_DEVICES",
    "UB_SKIPMC",
)

# Extension functions the Python side calls (jax_ub.comm, overlap.py); an installed extension without
# them is an older build than this checkout.
REQUIRED_EXT_FUNCTIONS = (
    "registrations",
    "runtime_info",
    "cublaslt_description",
    "set_library_candidates",
    "comm_create",
    "comm_connect_local",
    "comm_export_ipc",
    "comm_connect_ipc",
    "comm_grow",
    "comm_drain",
    "comm_destroy_set",
    "comm_error",
    "gemm_warmup",
    "p2p_matrix",
    "pci_bus_ids",
)

LIVE_ROWS_PER_GPU = 256
LIVE_COLS = 1024
LIVE_WARMUP = 2
LIVE_REPEATS = 5
# The live test's process waits at most this long for a peer (JAX_UB_TIMEOUT, if that is longer),
# and is killed after LIVE_WALL_S in all (jax's start and compilation included).
LIVE_TIMEOUT_S = 30.0
LIVE_WALL_S = 240.0
LIVE_RESULT_MARK = "jax_ub-doctor-live-result: "  # the child's result line (JSON follows)
TOPO_TIMEOUT_S = 10


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------------
# 1. versions


def nccl_version_string(code: int) -> str:
    """``ncclGetVersion``'s code as ``major.minor.patch`` (two encodings: before and since 2.9)."""
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"  # older: major*1000 + minor*100 + patch


def nccl_version(path: str | None) -> dict[str, Any]:
    """Loads ``libnccl.so.2`` from ``path`` with ctypes and asks ``ncclGetVersion``; never raises."""
    out: dict[str, Any] = {"path": path, "code": None, "version": None, "error": None}
    if not path:
        out["error"] = "libnccl.so.2 not found in an nvidia-nccl wheel on sys.path"
        return out
    try:
        lib = ctypes.CDLL(path)
        code = ctypes.c_int(0)
        rc = lib.ncclGetVersion(ctypes.byref(code))
    except (OSError, AttributeError) as e:
        out["error"] = f"cannot load {path}: {_err(e)}"
        return out
    if rc != 0:
        out["error"] = f"ncclGetVersion returned {rc}"
        return out
    out["code"] = int(code.value)
    out["version"] = nccl_version_string(int(code.value))
    return out


def _cuda_version_string(v: int | None) -> str | None:
    """CUDA's integer versions (12040) as ``12.4``; None/0 as None."""
    if not v:
        return None
    return f"{v // 1000}.{v % 1000 // 10}"


def gather_versions() -> dict[str, Any]:
    """Versions of python/jax/jaxlib/jax_ub, the extension's build and load state, the CUDA driver,
    cuBLASLt and NCCL."""
    import jax_ub

    try:
        import jaxlib

        jaxlib_version = getattr(jaxlib, "__version__", None)
    except ImportError:
        jaxlib_version = None
    facts = dict(_ext._build_facts())
    try:
        mod, load_reason = _ext._load()
    except Exception as e:  # the loader itself failed (e.g. set_library_candidates raised)
        mod, load_reason = None, f"loading the extension raised {_err(e)}"
    ext: dict[str, Any] = {
        "built": bool(facts.get("cuda_built")),
        "build_reason": facts.get("reason") or None,
        "build_facts": facts,
        "loaded": mod is not None,
        "load_error": (load_reason or None) if mod is None else None,
        "file": getattr(mod, "__file__", None),
        "build_info": None,
        "missing_functions": [],
        "source": None,
    }
    cuda: dict[str, Any] = {"driver_version": None, "driver": None, "device_count": None, "error": None}
    libs = _ext.find_libraries()
    cublaslt: dict[str, Any] = {"paths": libs.get("cublasLt", []), "description": None}
    if mod is not None:
        ext["missing_functions"] = [f for f in REQUIRED_EXT_FUNCTIONS if not hasattr(mod, f)]
        try:
            ext["build_info"] = dict(mod.build_info())
        except Exception as e:
            ext["build_info"] = {"error": _err(e)}
        ext["source"] = gather_source(mod)
        ext["driver_too_old"] = _ext.driver_too_old(mod)
        try:
            rt = dict(mod.runtime_info())
            cuda["driver_version"] = rt.get("driver_version") or None
            cuda["driver"] = _cuda_version_string(rt.get("driver_version"))
            cuda["device_count"] = rt.get("device_count")
            cuda["error"] = rt.get("error")
        except Exception as e:
            cuda["error"] = _err(e)
        try:
            cublaslt["description"] = str(mod.cublaslt_description())
        except Exception as e:
            cublaslt["description"] = _err(e)
    else:
        cuda["error"] = "unknown: the extension (which asks the CUDA runtime) is not loaded"
    cuda["libcuda_error"] = libcuda_error()
    nccl_paths = libs.get("nccl", [])
    nccl = nccl_version(nccl_paths[0] if nccl_paths else None)
    nccl["paths"] = nccl_paths
    if mod is not None and hasattr(mod, "nccl_version"):  # extensions with the NCCL bindings
        try:
            code = int(mod.nccl_version())
            nccl["extension_view"] = {
                "version": nccl_version_string(code) if code > 0 else None,
                "library": str(mod.nccl_library()) if hasattr(mod, "nccl_library") else None,
                "load_error": (str(mod.nccl_load_error()) or None)
                if hasattr(mod, "nccl_load_error")
                else None,
            }
        except Exception as e:
            nccl["extension_view"] = {"version": None, "library": None, "load_error": _err(e)}
    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "jax": jax.__version__,
        "jaxlib": jaxlib_version,
        "jax_ub": getattr(jax_ub, "__version__", None),
        "extension": ext,
        "cuda": cuda,
        "cublaslt": cublaslt,
        "nccl": nccl,
    }


def gather_source(mod: Any) -> dict[str, Any]:
    """Which sources the loaded extension was built from, against the checkout's ``csrc/`` (none
    for an installed wheel): ``stale`` says why they differ, else None."""
    out: dict[str, Any] = {
        "extension_hash": None,
        "checkout": _ext.checkout_csrc(),
        "checkout_hash": None,
        "stale": None,
    }
    with contextlib.suppress(Exception):
        out["extension_hash"] = dict(mod.build_info()).get("source_hash")
    if out["checkout"] is None:
        return out
    try:
        out["checkout_hash"] = _ext.source_hash(out["checkout"])
        out["stale"] = _ext.source_mismatch(mod, out["checkout"])
    except OSError as e:
        out["error"] = f"cannot hash {out['checkout']}: {_err(e)}"
    return out


def libcuda_error() -> str | None:
    """None when the NVIDIA driver's ``libcuda.so.1`` loads, else why not."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------------------
# 2. GPUs


def gather_gpus() -> dict[str, Any]:
    """jax's CUDA devices (all processes), this process's ones, and jax.distributed's state."""
    out: dict[str, Any] = {
        "backend": None,
        "devices": [],
        "local_ids": [],
        "error": None,
        "process_index": 0,
        "process_count": 1,
        "distributed": False,
    }
    try:
        out["backend"] = jax.default_backend()
    except Exception as e:
        out["error"] = _err(e)
    try:
        devices = jax.devices("cuda")
    except Exception as e:  # no CUDA backend in this jaxlib, or it failed to start
        devices = []
        out["error"] = out["error"] or _err(e)
    try:
        out["process_index"] = jax.process_index()
        out["process_count"] = jax.process_count()
    except Exception as e:
        out["error"] = out["error"] or _err(e)
    is_init = getattr(jax.distributed, "is_initialized", None)
    with contextlib.suppress(Exception):
        out["distributed"] = bool(is_init()) if is_init is not None else out["process_count"] > 1
    mod = _ext.extension() if devices else None
    for d in devices:
        ordinal = getattr(d, "local_hardware_id", None)
        entry: dict[str, Any] = {
            "id": d.id,
            "device_kind": d.device_kind,
            "process_index": d.process_index,
            "local_hardware_id": ordinal,
        }
        if mod is not None and ordinal is not None and d.process_index == out["process_index"]:
            try:
                free_b, total_b = mod.device_memory(ordinal)
                entry["memory_free"], entry["memory_total"] = int(free_b), int(total_b)
            except Exception:  # older extension, or the query failed: memory is only informative
                pass
        out["devices"].append(entry)
    out["local_ids"] = [e["id"] for e in out["devices"] if e["process_index"] == out["process_index"]]
    return out


# ------------------------------------------------------------------------------------------------
# 3. P2P and topology


def gather_p2p() -> dict[str, Any]:
    """``can_access[i][j]`` between CUDA ordinals i and j, from the extension."""
    mod = _ext.extension()
    if mod is None:
        return {"matrix": None, "error": "the extension is not loaded"}
    if not hasattr(mod, "p2p_matrix"):
        return {"matrix": None, "error": "the installed extension has no p2p_matrix (older build)"}
    try:
        m = [[int(bool(v)) for v in row] for row in mod.p2p_matrix()]
    except Exception as e:
        return {"matrix": None, "error": _err(e)}
    return {"matrix": m, "error": None if m else "the CUDA runtime sees no device"}


def gather_topology() -> dict[str, Any]:
    """``nvidia-smi topo -m`` (NVLink/PCIe links between GPUs) when nvidia-smi is installed."""
    exe = shutil.which("nvidia-smi")
    out: dict[str, Any] = {"nvidia_smi": exe, "output": None, "error": None}
    if exe is None:
        out["error"] = "nvidia-smi not found on PATH"
        return out
    try:
        r = subprocess.run(
            [exe, "topo", "-m"], capture_output=True, text=True, timeout=TOPO_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        out["error"] = f"nvidia-smi topo -m did not finish within {TOPO_TIMEOUT_S} s"
        return out
    except OSError as e:
        out["error"] = _err(e)
        return out
    if r.returncode != 0:
        out["error"] = f"nvidia-smi topo -m exited with {r.returncode}: {(r.stderr or r.stdout).strip()}"
    out["output"] = r.stdout.rstrip() or None
    return out


def no_p2p_pairs(matrix: Sequence[Sequence[int]], ordinals: Sequence[int]) -> list[tuple[int, int]]:
    """Pairs (i < j) of ``ordinals`` where i cannot access j or j cannot access i."""
    n = len(matrix)
    bad = []
    for a, i in enumerate(ordinals):
        for j in ordinals[a + 1 :]:
            if i >= n or j >= n or not (matrix[i][j] and matrix[j][i]):
                bad.append((i, j))
    return bad


def p2p_group(matrix: Sequence[Sequence[int]], ordinals: Sequence[int]) -> list[int]:
    """A set of ``ordinals`` that can all access each other (greedy, starting at the first)."""
    group: list[int] = []
    for i in ordinals:
        if not no_p2p_pairs(matrix, [*group, i]):
            group.append(i)
    return group


# ------------------------------------------------------------------------------------------------
# 4. configuration and decision


def gather_config(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The configuration jax_ub would read from this environment, multicast, relevant variables."""
    env = dict(os.environ if environ is None else environ)
    out: dict[str, Any] = {
        "config": None,
        "error": None,
        "env": {k: env.get(k) for k in ENV_VARS},
        "jax_ub_env": {k: v for k, v in sorted(env.items()) if k.startswith("JAX_UB_")},
        "unknown_variables": unknown_variables(env),
    }
    try:
        cfg = config.Config.from_env(env)
        out["config"] = dataclasses.asdict(cfg)
    except ValueError as e:
        out["error"] = str(e)
    else:
        out["tuning"] = tuning_file_status(cfg.tuning_file)
    # jax_ub has no multicast (NVLS) path: it is never used. The two variables that once asked
    # for it or forbade it are read only to say that they do nothing.
    set_vars = [f"{k}={env[k]}" for k in ("JAX_UB_MULTICAST", "UB_SKIPMC") if env.get(k, "").strip()]
    if set_vars:
        verb = "does" if len(set_vars) == 1 else "do"
        reason = (
            f"none: {' and '.join(set_vars)} {verb} nothing (no multicast path; "
            "the variables will be removed)"
        )
    else:
        reason = "none (no multicast path; NVLink multicast is never used)"
    out["multicast"] = {"enabled": False, "reason": reason}
    return out


def unknown_variables(env: dict[str, str]) -> list[dict[str, Any]]:
    """The ``JAX_UB_*`` variables of ``env`` that jax_ub ignores (no knob has that name), each with
    the knob it most likely misspells (``did_you_mean``, or None)."""
    out = []
    for name in config.unknown_variables(env):
        out.append({"name": name, "value": env[name], "did_you_mean": config.closest_setting(name)})
    return out


def _unknown_sentence(u: dict[str, Any]) -> str:
    hint = f" (did you mean {u['did_you_mean']}?)" if u["did_you_mean"] else ""
    return f"{u['name']}={u['value']} is not a jax_ub setting: it is ignored{hint}"


def tuning_file_status(path: str) -> dict[str, Any] | None:
    """None without ``JAX_UB_TUNING_FILE``; else what ``auto`` would read from it, or why it
    cannot (the first op traced would fail with the same error)."""
    if not path:
        return None
    from jax_ub import choice

    try:
        shapes = choice.load_bench_file(path)
    except ValueError as e:
        return {"path": path, "ok": False, "error": str(e)}
    ops = sorted({f"{s.op} tp{s.tp}" for s in shapes})
    return {"path": path, "ok": True, "shapes": len(shapes), "ops": ops}


def nccl_transport_implemented() -> bool:
    """Whether ``jax_ub.initialize`` can use the NCCL bootstrap/transport."""
    from jax_ub import comm

    return "nccl" in getattr(comm, "IMPLEMENTED_TRANSPORTS", ("ipc",))


def decide(gpus: dict[str, Any], p2p: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Which bootstrap and transport ``jax_ub.initialize(mesh of every GPU, "tp")`` uses here."""
    c = cfg.get("config") or {}
    nccl_ok = nccl_transport_implemented()
    local = [d for d in gpus["devices"] if d["id"] in gpus["local_ids"]]
    ordinals = [d["local_hardware_id"] if d.get("local_hardware_id") is not None else d["id"] for d in local]
    nprocs = gpus.get("process_count", 1)
    out: dict[str, Any] = {
        "processes": nprocs,
        "gpus": len(gpus["devices"]),
        "local_gpus": len(local),
        "nccl_transport_implemented": nccl_ok,
        "no_p2p_pairs": [],
        "blocking": None,
    }

    # bootstrap
    want_b = c.get("bootstrap", "auto")
    if want_b == "nccl":
        out["bootstrap"] = "nccl"
        out["bootstrap_reason"] = "forced by JAX_UB_BOOTSTRAP=nccl (NCCL unique id through the KV store)"
    elif nprocs > 1:
        out["bootstrap"] = "kv"
        out["bootstrap_reason"] = (
            f"jax.distributed is initialized with {nprocs} processes: CUDA IPC "
            "handles travel through its key-value store"
        )
    elif len(local) >= 2:
        out["bootstrap"] = "local"
        out["bootstrap_reason"] = (
            f"one process drives all {len(local)} local GPUs: peers are wired "
            "in-process, nothing is exchanged"
        )
    else:
        out["bootstrap"] = "local"
        out["bootstrap_reason"] = f"one process with {len(local)} local CUDA GPU(s)"
    # transport
    want_t = c.get("transport", "auto")
    if want_t != "auto":
        out["transport"] = want_t
        out["transport_reason"] = f"forced by JAX_UB_TRANSPORT={want_t}"
        bad = (
            no_p2p_pairs(p2p["matrix"], ordinals)
            if want_t == "ipc" and len(local) >= 2 and p2p.get("matrix") is not None
            else []
        )
        out["no_p2p_pairs"] = [list(b) for b in bad]
        if bad:  # jax_ub.initialize raises this (jax_ub.comm.transport.choose_transport)
            pairs = "; ".join(f"GPU {i} and GPU {j} cannot access each other" for i, j in bad)
            out["blocking"] = (
                f"initialize: transport='ipc' needs every pair of GPUs of a group to map "
                f"each other's memory, but {pairs}: use transport='nccl' or 'auto' "
                "(JAX_UB_TRANSPORT=ipc forces ipc: unset it)"
            )
    elif len(local) < 2:
        out["transport"] = None
        out["transport_reason"] = f"none needed: {len(local)} local CUDA GPU(s)"
    elif p2p.get("matrix") is None:
        out["transport"] = None
        out["transport_reason"] = f"unknown: no P2P matrix ({p2p.get('error')})"
    else:
        bad = no_p2p_pairs(p2p["matrix"], ordinals)
        out["no_p2p_pairs"] = [list(b) for b in bad]
        if not bad:
            out["transport"] = "ipc"
            out["transport_reason"] = (
                f"every pair of the {len(local)} local GPUs can access each other "
                "(P2P): copy engine over peer-mapped memory"
            )
        else:
            out["transport"] = "nccl"
            out["transport_reason"] = (
                "; ".join(f"GPU {i} and GPU {j} cannot access each other" for i, j in bad)
                + ": transport nccl"
            )
    if "nccl" in (out["bootstrap"], out["transport"]) and not nccl_ok:
        what = "bootstrap" if out["bootstrap"] == "nccl" else "transport"
        if want_b == "nccl" or want_t == "nccl":
            out["blocking"] = (
                f"the NCCL {what} (forced by JAX_UB_{what.upper()}=nccl) is not available "
                "in this version of jax_ub: unset it"
            )
        else:
            group = p2p_group(p2p["matrix"], ordinals)
            out["p2p_group"] = group
            out["note"] = (
                "this version of jax_ub implements only the ipc transport: a TP group must "
                "consist of GPUs that can all access each other, e.g. GPUs "
                f"{', '.join(map(str, group))}"
            )
    return out


# ------------------------------------------------------------------------------------------------
# 5. live test


def run_live_test(
    device_ids: Sequence[int], platform: str = "cuda", repeats: int = LIVE_REPEATS, warmup: int = LIVE_WARMUP
) -> dict[str, Any]:
    """``jax_ub.overlap.all_gather`` over a 1-D ``("tp",)`` mesh of ``device_ids``: checked to
    equal its input bit for bit, timed (median of ``repeats`` after ``warmup``). Never raises."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ub

    out: dict[str, Any] = {"ran": True, "ok": False, "devices": list(device_ids), "error": None}
    with contextlib.suppress(ValueError):  # an invalid configuration fails initialize below
        out["timeout_s"] = config.get().timeout_s
    started = False
    try:
        by_id = {d.id: d for d in jax.devices(platform)}
        devs = [by_id[i] for i in device_ids]
        world = len(devs)
        kw = {}
        if hasattr(jax.sharding, "AxisType"):
            kw["axis_types"] = (jax.sharding.AxisType.Auto,)
        mesh = Mesh(np.array(devs), ("tp",), **kw)
        shape = (world * LIVE_ROWS_PER_GPU, LIVE_COLS)
        out["shape"], out["dtype"] = list(shape), "bfloat16"
        started = True  # shutdown() also after a half-done initialize (it is safe to call twice)
        jax_ub.initialize(mesh, "tp")
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
        x = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
        f = jax.jit(
            jax.shard_map(
                lambda a: jax_ub.overlap.all_gather(a, "tp"),
                mesh=mesh,
                in_specs=P("tp", None),
                out_specs=P(),
                check_vma=False,
            )
        )
        y = jax.block_until_ready(f(x))
        want = np.asarray(x).view(np.uint16)
        for shard in y.addressable_shards:
            got = np.asarray(shard.data)
            if got.shape != want.shape or not np.array_equal(got.view(np.uint16), want):
                diff = int(np.sum(got.view(np.uint16) != want)) if got.shape == want.shape else None
                raise AssertionError(
                    f"all_gather on device {shard.device.id} differs from its input "
                    + (
                        f"in {diff} of {want.size} elements"
                        if diff is not None
                        else f"(shape {got.shape}, want {want.shape})"
                    )
                )
        for _ in range(max(warmup - 1, 0)):
            jax.block_until_ready(f(x))
        times = []
        for _ in range(max(repeats, 1)):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        nbytes = shape[0] * shape[1] * 2
        out.update(
            ok=True,
            median_ms=t * 1e3,
            bytes=nbytes,
            algbw_gbps=nbytes / t / 1e9,
            busbw_gbps=nbytes * (world - 1) / world / t / 1e9,
        )
    except Exception as e:
        out["error"] = _err(e)
    finally:
        if started:
            try:
                jax_ub.shutdown()
            except Exception as e:
                out["ok"] = False
                out["error"] = (out["error"] + "; " if out["error"] else "") + f"shutdown: {_err(e)}"
    return out


def _live_child_command(device_ids: Sequence[int], platform: str) -> list[str]:
    """The command of the live test's process: this jax_ub's :func:`run_live_test`, whose result
    it prints as one ``LIVE_RESULT_MARK`` line."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        f"import sys; sys.path.insert(0, {root!r}); from jax_ub import doctor; "
        f"doctor._live_child({list(device_ids)!r}, {platform!r})"
    )
    return [sys.executable, "-c", code]


def _live_child(device_ids: list[int], platform: str) -> None:
    r = run_live_test(device_ids, platform=platform)
    print(LIVE_RESULT_MARK + json.dumps(r, default=str), flush=True)


def _tail(text: str | bytes | None, lines: int = 12) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    kept = (text or "").strip().splitlines()[-lines:]
    return ("; its last output:\n" + "\n".join(kept)) if kept else ""


def run_live_test_bounded(
    device_ids: Sequence[int], timeout_s: float, platform: str = "cuda", wall_s: float = LIVE_WALL_S
) -> dict[str, Any]:
    """:func:`run_live_test` in a child process whose waits for a peer are bounded by
    ``min(timeout_s, LIVE_TIMEOUT_S)`` (``JAX_UB_TIMEOUT``) and which is killed after ``wall_s``:
    a stall that aborts it (``JAX_UB_ON_STALL=abort``) or a hang is a failed test, reported with
    the end of its output. Never raises."""
    t = min(float(timeout_s), LIVE_TIMEOUT_S)
    out: dict[str, Any] = {
        "ran": True,
        "ok": False,
        "devices": list(device_ids),
        "error": None,
        "timeout_s": t,
        "wall_s": wall_s,
    }
    env = dict(
        os.environ,
        JAX_UB_TIMEOUT=f"{t:g}",
        # this process's jax holds its share of every GPU already; the test needs little
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
    )
    try:
        r = subprocess.run(
            _live_child_command(device_ids, platform),
            capture_output=True,
            text=True,
            timeout=wall_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        out["error"] = (
            f"the live test's process did not finish within {wall_s:g} s (waits for a peer "
            f"bounded at {t:g} s) and was killed{_tail(e.stderr)}"
        )
        return out
    except OSError as e:
        out["error"] = f"cannot start the live test's process: {_err(e)}"
        return out
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(LIVE_RESULT_MARK):
            try:
                res = json.loads(line[len(LIVE_RESULT_MARK) :])
            except ValueError as e:
                out["error"] = f"the live test's process printed an unreadable result: {_err(e)}"
                return out
            return {**out, **res, "wall_s": wall_s}
    rc = r.returncode
    how = (
        f"was ended by {signal.Signals(-rc).name}"
        if rc < 0 and -rc in signal.valid_signals()
        else f"exited with {rc}"
    )
    out["error"] = f"the live test's process {how} before reporting a result{_tail(r.stderr or r.stdout)}"
    return out


# ------------------------------------------------------------------------------------------------
# 6. report, verdict, text


def _blocking_reasons(r: dict[str, Any]) -> list[str]:
    """Everything that stops ``jax_ub.initialize`` + an overlapped op from running, in order."""
    v, g, c, d = r["versions"], r["gpus"], r["config"], r["decision"]
    ext = v["extension"]
    reasons = []
    if not ext["built"]:
        reasons.append(f"the CUDA extension is not built: {ext['build_reason'] or 'no reason recorded'}")
    elif not ext["loaded"]:
        reasons.append(f"the CUDA extension cannot be loaded: {ext['load_error']}")
    elif ext["missing_functions"]:
        reasons.append(
            f"the installed CUDA extension ({ext['file']}) is older than this jax_ub: it lacks "
            f"{', '.join(ext['missing_functions'])}; rebuild it with `pip install .`"
        )
    elif (ext.get("source") or {}).get("stale"):
        reasons.append(ext["source"]["stale"])
    elif ext.get("driver_too_old"):
        reasons.append(ext["driver_too_old"])
    if c.get("error"):
        reasons.append(f"invalid jax_ub configuration: {c['error']}")
    elif (c.get("tuning") or {}).get("ok") is False:
        reasons.append(f"invalid tuning file: {c['tuning']['error']}")
    elif (c.get("config") or {}).get("disable"):
        reasons.append("JAX_UB_DISABLE=1 forces the pure-XLA reference path")
    n = len(g["devices"])
    if n == 0:
        reasons.append(_no_gpu_reason(v, g))
    else:
        lt = v["cublaslt"].get("description")
        if ext["loaded"] and lt is not None and not lt.startswith("cuBLASLt "):
            reasons.append(f"cuBLASLt unavailable: {lt}")
        if n < 2:
            reasons.append(f"fewer than 2 GPUs: only {n} CUDA GPU, TP overlap needs at least 2")
    if d.get("blocking"):
        reasons.append(d["blocking"])
    live = r.get("live") or {}
    if live.get("ran") and not live.get("ok"):
        reasons.append(f"live test failed: {live.get('error')}")
    return reasons


def _cuda_extra(driver_version: int | None) -> str:
    """The jax extra that matches a driver (``cudaDriverGetVersion``: 12040 is CUDA 12.4)."""
    return "cuda13" if (driver_version or 0) >= 13000 else "cuda12"


def _no_gpu_reason(v: dict[str, Any], g: dict[str, Any]) -> str:
    """Why jax has no CUDA GPU here, with what to do: jax without its CUDA backend on a machine
    whose CUDA runtime counts GPUs, no NVIDIA driver, or what the CUDA runtime said."""
    cuda, ext = v["cuda"], v["extension"]
    backend = g.get("backend")
    count = cuda.get("device_count") or 0
    if count > 0:
        extra = _cuda_extra(cuda.get("driver_version"))
        seen = f": {g['error']}" if g.get("error") else ""
        return (
            f"no CUDA GPU (jax backend: {backend}): jax has no CUDA backend{seen}, but the CUDA "
            f"runtime counts {count} GPU(s) (driver {cuda.get('driver') or '?'}): install jax with "
            f'its CUDA extra, `pip install -U "jax[{extra}]"` (or jax_ub\'s `".[{extra}]"`)'
        )
    err = cuda.get("error") or ""
    if cuda.get("libcuda_error") and (not ext["loaded"] or "InsufficientDriver" in err or "NoDevice" in err):
        return (
            f"no CUDA GPU (jax backend: {backend}): no NVIDIA driver found (libcuda.so.1 cannot be "
            f"loaded: {cuda['libcuda_error']}); the CUDA path needs NVIDIA GPUs and their driver"
        )
    extra = f"; CUDA runtime: {err}" if ext["loaded"] and err else ""
    return f"no CUDA GPU (jax backend: {backend}{extra})"


def _live_plan(r: dict[str, Any], no_live: bool) -> tuple[list[int] | None, str]:
    """(jax device ids to test, "") or (None, why the live test is skipped)."""
    if no_live:
        return None, "skipped (--no-live)"
    if _blocking_reasons(r):
        return None, "skipped: overlap cannot run here (see the verdict)"
    g, d = r["gpus"], r["decision"]
    if g.get("process_count", 1) > 1:
        return None, "skipped: jax.distributed has several processes (run it in one process)"
    ids = list(g["local_ids"])
    if d.get("transport") == "nccl" and not d.get("nccl_transport_implemented"):
        ordinal_to_id = {
            (e["local_hardware_id"] if e.get("local_hardware_id") is not None else e["id"]): e["id"]
            for e in g["devices"]
            if e["id"] in ids
        }
        ids = [ordinal_to_id[o] for o in d.get("p2p_group", []) if o in ordinal_to_id]
    if len(ids) < 2:
        return None, "skipped: fewer than 2 local GPUs can take part"
    return ids, ""


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    reasons = _blocking_reasons(r)
    d = r["decision"]
    notes = []
    if d.get("transport") == "nccl":
        notes.append(d["transport_reason"])
    if d.get("note"):
        notes.append(d["note"])
    notes.extend(_unknown_sentence(u) for u in r["config"].get("unknown_variables") or [])
    live = r.get("live") or {}
    if live.get("ran") and live.get("ok") and len(live.get("devices", [])) < d["local_gpus"]:
        notes.append(f"the live test ran on GPUs {live['devices']} only")
    if reasons:
        return {
            "ok": False,
            "exit_code": 1,
            "reasons": reasons,
            "notes": notes,
            "message": "CANNOT RUN OVERLAP: " + "; ".join(reasons),
        }
    transport = d.get("transport") or "ipc"
    return {
        "ok": True,
        "exit_code": 0,
        "reasons": [],
        "notes": notes,
        "message": f"OK: overlap can run (transport {transport}, {d['gpus']} GPUs)",
    }


def collect(no_live: bool = False) -> dict[str, Any]:
    """Every section of the report (the gatherers are module attributes so tests can swap them)."""
    r: dict[str, Any] = {
        "versions": gather_versions(),
        "gpus": gather_gpus(),
        "p2p": gather_p2p(),
        "topology": gather_topology(),
        "config": gather_config(),
    }
    r["decision"] = decide(r["gpus"], r["p2p"], r["config"])
    ids, why = _live_plan(r, no_live)
    timeout_s = (r["config"].get("config") or {}).get("timeout_s", LIVE_TIMEOUT_S)
    r["live"] = (
        run_live_test_bounded(ids, timeout_s)
        if ids is not None
        else {"ran": False, "ok": None, "skipped": why}
    )
    r["verdict"] = verdict(r)
    return r


def _gib(b: int) -> str:
    return f"{b / (1 << 30):.1f} GiB"


def _p2p_table(m: list[list[int]]) -> list[str]:
    head = "        " + "".join(f"{'GPU' + str(j):>6}" for j in range(len(m)))
    rows = [head]
    for i, row in enumerate(m):
        cells = "".join(f"{'-' if i == j else ('yes' if v else 'NO'):>6}" for j, v in enumerate(row))
        rows.append(f"  {'GPU' + str(i):<6}{cells}")
    return rows


def render_text(r: dict[str, Any]) -> str:
    v, g, p, t, c, d, live = (
        r[k] for k in ("versions", "gpus", "p2p", "topology", "config", "decision", "live")
    )
    ext, cuda, nccl = v["extension"], v["cuda"], v["nccl"]
    L: list[str] = ["jax_ub doctor", ""]

    L.append("== Versions ==")
    L.append(f"  python        {v['python']} ({v['python_executable']})")
    L.append(f"  jax / jaxlib  {v['jax']} / {v['jaxlib']}")
    L.append(f"  jax_ub        {v['jax_ub']}")
    if not ext["built"]:
        L.append(f"  extension     NOT BUILT: {ext['build_reason']}")
    else:
        bf = ext["build_facts"]
        built = f"built with nvcc {bf.get('nvcc_version')} for archs {bf.get('cuda_archs')}"
        if not ext["loaded"]:
            L.append(f"  extension     {built}; CANNOT LOAD: {ext['load_error']}")
        else:
            bi = ext.get("build_info") or {}
            rt = _cuda_version_string(bi.get("cuda_runtime_version"))
            L.append(f"  extension     {built}, CUDA runtime {rt}; loaded from {ext['file']}")
            if ext["missing_functions"]:
                L.append(f"                older build: lacks {', '.join(ext['missing_functions'])}")
            src = ext.get("source") or {}
            built = (src.get("extension_hash") or "")[:12] or "unrecorded"
            if src.get("stale"):
                L.append(f"  sources       OTHER THAN THIS CHECKOUT'S: {src['stale']}")
            elif src.get("checkout_hash"):
                L.append(f"  sources       {built}: those of this checkout ({src['checkout']})")
            elif src.get("error"):
                L.append(f"  sources       {built}; not compared: {src['error']}")
            else:
                L.append(f"  sources       {built} (no checkout to compare with: an installed package)")
    driver = cuda.get("driver") or (
        "unavailable"
        if not cuda.get("libcuda_error")
        else f"none: libcuda.so.1 cannot be loaded ({cuda['libcuda_error']})"
    )
    count = cuda.get("device_count")
    L.append(
        f"  CUDA driver   {driver}; devices: {'?' if count is None else count}"
        + (f" ({cuda['error']})" if cuda.get("error") else "")
    )
    lt = v["cublaslt"]
    L.append(f"  cuBLASLt      {lt.get('description') or (lt['paths'][0] if lt['paths'] else 'not found')}")
    if nccl.get("version"):
        L.append(f"  NCCL          {nccl['version']} (code {nccl['code']}) from {nccl['path']}")
    else:
        L.append(f"  NCCL          unavailable: {nccl.get('error')}")
    ev = nccl.get("extension_view")
    if ev:
        L.append(
            f"                the extension loads NCCL {ev['version']} from {ev['library']}"
            if ev["version"]
            else f"                the extension cannot load NCCL: {ev['load_error']}"
        )
    L.append("")

    L.append("== GPUs ==")
    if not g["devices"]:
        L.append(f"  no CUDA GPU (backend: {g.get('backend')})")
    if g.get("error"):
        L.append(f"  jax: {g['error']}")
    for e in g["devices"]:
        mem = f", {_gib(e['memory_free'])} free of {_gib(e['memory_total'])}" if "memory_total" in e else ""
        L.append(
            f"  id {e['id']}: {e['device_kind']} (process {e['process_index']}, "
            f"local_hardware_id {e['local_hardware_id']}{mem})"
        )
    L.append(
        f"  processes: {g.get('process_count')} (jax.distributed "
        f"{'initialized' if g.get('distributed') else 'not initialized'})"
    )
    L.append("")

    L.append("== P2P and topology ==")
    if p.get("matrix"):
        L.append("  P2P (row can access column):")
        L.extend("  " + row for row in _p2p_table(p["matrix"]))
    else:
        L.append(f"  P2P matrix: unavailable ({p.get('error')})")
    if t.get("output"):
        L.append("  nvidia-smi topo -m:")
        L.extend("    " + line for line in t["output"].splitlines())
    if t.get("error"):
        L.append(f"  topology: {t['error']}")
    L.append("")

    L.append("== Decision (jax_ub.initialize on every local GPU) ==")
    L.append(f"  bootstrap   {d['bootstrap']}: {d['bootstrap_reason']}")
    L.append(f"  transport   {d['transport'] or '-'}: {d['transport_reason']}")
    if d.get("note"):
        L.append(f"  note        {d['note']}")
    L.append(f"  multicast   {c['multicast']['reason']}")
    if c.get("error"):
        L.append(f"  config      INVALID: {c['error']}")
    elif c.get("config"):
        cf = c["config"]
        L.append(
            f"  config      method={cf['method']} disable={int(cf['disable'])} "
            f"timeout_s={cf['timeout_s']:g} on_stall={cf['on_stall']} buffer_mib={cf['buffer_mib']}"
        )
    tf = c.get("tuning")
    if tf is not None:
        L.append(
            f"  tuning      {tf['path']}: "
            + (
                f"{tf['shapes']} measured shapes ({', '.join(tf['ops'])}), auto chooses from them first"
                if tf["ok"]
                else f"UNUSABLE: {tf['error']}"
            )
        )
    L.append("  environment:")
    unknown = {u["name"]: u for u in c.get("unknown_variables") or []}
    for k, val in [*c["env"].items(), *c["jax_ub_env"].items()]:
        flag = ""
        if k in unknown:
            hint = unknown[k]["did_you_mean"]
            flag = "   <- not a jax_ub setting: ignored" + (f" (did you mean {hint}?)" if hint else "")
        L.append(f"    {k:<32}{'(unset)' if val is None else val}{flag}")
    L.append("")

    L.append("== Live all-gather test ==")
    if not live.get("ran"):
        L.append(f"  {live.get('skipped')}")
    elif live.get("ok"):
        L.append(
            f"  all_gather of bf16 {live['shape']} over GPUs {live['devices']}: equal to the input; "
            f"{live['median_ms']:.3f} ms median, algbw {live['algbw_gbps']:.1f} GB/s, "
            f"busbw {live['busbw_gbps']:.1f} GB/s"
        )
    else:
        L.append(f"  FAILED on GPUs {live.get('devices')}: {live.get('error')}")
    L.append("")

    vd = r["verdict"]
    L.extend(f"note: {n}" for n in vd["notes"])
    L.append(vd["message"])
    return "\n".join(_indent_continuations(line) for line in L)


_LABEL = re.compile(r"^ *\S+(?: \S+)*?  +(?=\S)")  # "  jax / jaxlib  " of "  jax / jaxlib  0.10.2"


def _indent_continuations(line: str) -> str:
    """A report line whose value spans several lines (e.g. a library's load error listing what it
    tried): its continuation lines indented to the value's column (under a label such as
    ``  NCCL          ``), else two spaces deeper than the line itself."""
    first, *rest = line.split("\n")
    if not rest:
        return line
    m = _LABEL.match(first)
    pad = " " * (m.end() if m else len(first) - len(first.lstrip(" ")) + 2)
    return "\n".join([first, *(pad + r if r.strip() else r for r in rest)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jax_ub.doctor",
        description="Says whether jax_ub's TP overlap can run on this machine, and if not, why not.",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    ap.add_argument("--no-live", action="store_true", help="skip the live all-gather test on the GPUs")
    a = ap.parse_args(argv)
    report = collect(no_live=a.no_live)
    if a.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_text(report))
    return int(report["verdict"]["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
