"""CPU tier: examples/train_llama.py (the README's first command) and examples/train_tp_block.py as a
user runs them (one process, and two via launch.sh)."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_tp_block.py"
LLAMA = REPO / "examples" / "train_llama.py"
LAUNCH = REPO / "examples" / "launch.sh"
FAILFAST = REPO / "examples" / "failfast.py"
TINY = [
    "--hidden",
    "32",
    "--heads",
    "4",
    "--ffn",
    "64",
    "--seq",
    "16",
    "--batch",
    "4",
    "--motif",
    "4",
    "--vocab",
    "32",
]
LOSS = re.compile(r"step\s+(\d+)\s+loss\s+(\S+)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_UB_METHOD"}  # unless `extra` sets it
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    # Let the script choose its own simulated device count (tests/conftest.py forces 8 here).
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc


def _losses(stdout: str) -> list[float]:
    return [float(m.group(2)) for m in LOSS.finditer(stdout)]


def _describe(proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n"
        f"--- stderr ---\n{proc.stderr[-3000:]}"
    )


def test_readme_first_command_runs_the_llama_example():
    """The README's first command is examples/train_llama.py, with no option."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Two commands\n") :]
    first = re.search(r"```\n(.*?)\n```", section, re.S)
    assert first and first.group(1).endswith("python examples/train_llama.py"), first


def _last_mean(losses: list[float], k: int = 3) -> float:
    return sum(losses[-k:]) / k


def test_llama_example_trains_and_fp8_converges_like_it():
    """The Llama example as the README runs it (CPU defaults: a tiny model, 60 steps) learns the
    task; with --fp8 (every projection FP8, current scaling, e5m2 gradients) from the same seed
    and batches, the mean of its last logged losses is within 10 % of the float32 run's."""
    runs = {}
    for flags in ((), ("--fp8", "--remat", "dots")):
        proc = _run([sys.executable, str(LLAMA), "--log-every", "6", *flags], timeout=300)
        assert proc.returncode == 0, _describe(proc)
        out = proc.stdout
        assert "devices: 4 x cpu; mesh dp=1 tp=4; path: xla-reference" in out, out
        assert "2 layer(s), hidden 64, 8 heads / 4 kv heads of 8, ffn 128" in out, out
        assert out.rstrip().endswith("OK"), out
        losses = _losses(out)
        assert len(losses) == 11, losses
        assert _last_mean(losses) < 0.8 * losses[0], losses
        runs[flags] = losses
    plain, fp8 = runs[()], runs[("--fp8", "--remat", "dots")]
    assert "fp8 (e4m3 fwd, e5m2 bwd)" in proc.stdout
    assert abs(_last_mean(fp8) - _last_mean(plain)) <= 0.1 * _last_mean(plain), (plain, fp8)


def test_llama_example_configuration_errors_exit_2():
    proc = _run([sys.executable, str(LLAMA), "--heads", "6", "--kv-heads", "6"], timeout=120)
    assert proc.returncode == 2, _describe(proc)
    assert "error: --heads (6) must be divisible by tp (4)" in proc.stderr, proc.stderr


def test_one_process_trains_and_compares():
    proc = _run(
        [sys.executable, str(SCRIPT), "--steps", "40", "--log-every", "5", "--compare", *TINY], timeout=110
    )
    assert proc.returncode == 0, _describe(proc)
    out = proc.stdout
    assert "devices: 4 x cpu in 1 process(es); mesh dp=1 tp=4" in out
    assert out.count("path: method='xla' -> 'xla' (pure-XLA reference") == 1
    assert out.count("path: method='auto' -> 'xla' (pure-XLA reference") == 1
    assert out.count("tokens/s: ") == 2
    losses = _losses(out)
    assert len(losses) == 2 * 9  # step 1, 5, 10, ..., 40 for each run
    first_run = losses[:9]
    assert first_run[-1] < first_run[0] - 0.2, losses
    m = re.search(r"max \|loss\(xla\) - loss\(default\)\| = (\S+);", out)
    assert m and float(m.group(1)) == 0.0, out  # both runs take the reference path here
    assert "speedup default/xla = " in out and out.rstrip().endswith("OK")


def test_remat_keeps_the_losses():
    """--remat dots / full recompute the blocks in the backward: the same losses as without."""
    runs = {}
    for remat in ("none", "dots", "full"):
        proc = _run(
            [sys.executable, str(SCRIPT), "--steps", "12", "--log-every", "3", "--remat", remat, *TINY],
            timeout=110,
        )
        assert proc.returncode == 0, _describe(proc)
        runs[remat] = _losses(proc.stdout)
    assert len(runs["none"]) == 5
    np.testing.assert_allclose(runs["dots"], runs["none"], rtol=1e-5)
    np.testing.assert_allclose(runs["full"], runs["none"], rtol=1e-5)


def test_swiglu_mlp_trains():
    """--mlp swiglu: the gated ParallelMLP (one column layer for both halves) learns the task."""
    proc = _run(
        [sys.executable, str(SCRIPT), "--steps", "40", "--log-every", "5", "--mlp", "swiglu", *TINY],
        timeout=110,
    )
    assert proc.returncode == 0, _describe(proc)
    assert "ffn 64 (swiglu)" in proc.stdout, proc.stdout
    losses = _losses(proc.stdout)
    assert len(losses) == 9 and losses[-1] < losses[0] - 0.2, losses


def test_dp_tp_mesh_and_nan_loss_exits_nonzero():
    proc = _run([sys.executable, str(SCRIPT), "--steps", "3", "--dp", "2", "--lr", "nan", *TINY], timeout=90)
    assert "mesh dp=2 tp=2" in proc.stdout, _describe(proc)
    assert proc.returncode == 1, _describe(proc)
    assert "loss is not finite" in proc.stderr


@pytest.mark.parametrize(
    "argv,env,fragment",
    [
        (["--method", "ring"], {}, "error: method='ring' needs the CUDA overlap extension"),
        ([], {"JAX_UB_METHOD": "ring"}, "error: JAX_UB_METHOD=ring needs the CUDA overlap extension"),
        ([], {"JAX_UB_METHOD": "sideways"}, "error: JAX_UB_METHOD must be one of"),
        (["--method", "sideways"], {}, "argument --method: invalid choice: 'sideways'"),
        (
            ["--cpu-devices", "8", "--heads", "4"],
            {},
            "error: --heads (4) must be divisible by tp (8); tp = the 8 devices / --dp 1 unless --tp says "
            "otherwise: pass --tp and --dp with dp * tp = 8",
        ),
    ],
    ids=["cuda-method", "cuda-method-env", "bad-env", "bad-flag", "default-tp"],
)
def test_configuration_errors_exit_2_with_one_line(argv, env, fragment):
    """A configuration the CPU cannot run is a configuration error (exit 2, one `error:` line, no
    traceback), as examples/README.md says."""
    proc = _run([sys.executable, str(SCRIPT), "--steps", "3", *argv, *TINY], timeout=90, **env)
    assert proc.returncode == 2, _describe(proc)
    assert fragment in proc.stderr and "Traceback" not in proc.stderr, _describe(proc)


@pytest.mark.parametrize(
    "flag",
    [
        "--steps",
        "--batch",
        "--seq",
        "--motif",
        "--cpu-devices",
        "--hidden",
        "--heads",
        "--ffn",
        "--layers",
        "--vocab",
        "--dp",
        "--tp",
        "--log-every",
        "--num-processes",
        "--init-timeout",
        "--heartbeat-timeout",
    ],
)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_count_below_one_is_a_configuration_error(flag, value):
    """Zero or negative sizes, steps or device counts: `error: --X must be >= 1; got N`, exit 2,
    before jax starts (they used to end in a ZeroDivisionError, an IndexError or a backend error)."""
    proc = _run([sys.executable, str(SCRIPT), flag, value], timeout=60)
    assert proc.returncode == 2, _describe(proc)
    assert f"error: {flag} must be >= 1; got {value}" in proc.stderr, _describe(proc)
    assert "Traceback" not in proc.stderr and proc.stdout == "", _describe(proc)


def test_a_negative_process_id_is_a_configuration_error():
    proc = _run([sys.executable, str(SCRIPT), "--process-id", "-1"], timeout=60)
    assert proc.returncode == 2 and "error: --process-id must be >= 0; got -1" in proc.stderr, _describe(proc)


_BY_HAND = "a multi-process run by hand needs all of --coordinator, --num-processes and --process-id"


@pytest.mark.parametrize(
    "argv,env,fragment",
    [
        (
            ["--coordinator", "localhost:1234"],
            {},
            f"error: --coordinator without --num-processes and --process-id: {_BY_HAND}",
        ),
        (
            ["--coordinator", "localhost:1234", "--num-processes", "2"],
            {},
            f"error: --coordinator and --num-processes without --process-id: {_BY_HAND}",
        ),
        (
            ["--num-processes", "2", "--process-id", "1"],
            {},
            f"error: --num-processes and --process-id without --coordinator: {_BY_HAND}",
        ),
        (
            ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
            {},
            "error: --process-id (2) must be below --num-processes (2)",
        ),
        (["--init-timeout", "5"], {}, "error: --init-timeout only applies to a multi-process run"),
        (
            ["--init-timeout", "5", "--heartbeat-timeout", "5"],
            {},
            "error: --init-timeout and --heartbeat-timeout only apply to a multi-process run",
        ),
        (
            [],
            {"LAUNCH_COORDINATOR_ADDRESS": "127.0.0.1:1234"},
            "error: LAUNCH_COORDINATOR_ADDRESS is set but LAUNCH_NUM_PROCESSES is not",
        ),
        # jax's own IndexError (coordinator_address.rsplit(':', 1)[1]) before this check
        (
            ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
            {},
            "error: --coordinator must be HOST:PORT (process 0's host, and a free port there); "
            "got 'localhost'",
        ),
    ],
    ids=[
        "coordinator-alone",
        "no-process-id",
        "no-coordinator",
        "process-id-too-big",
        "timeout-one-process",
        "timeouts-one-process",
        "launch-env-incomplete",
        "coordinator-without-port",
    ],
)
def test_incomplete_multi_process_flags_are_argparse_errors(argv, env, fragment):
    """--coordinator without the others used to end in a KeyError, --num-processes/--process-id
    without --coordinator trained one process silently: now an argparse error (exit 2, before jax
    starts) naming the flags."""
    proc = _run([sys.executable, str(SCRIPT), *argv], timeout=60, **env)
    assert proc.returncode == 2, _describe(proc)
    assert fragment in proc.stderr, _describe(proc)
    assert "Traceback" not in proc.stderr and proc.stdout == "", _describe(proc)


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tp_block", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_distributed_kwargs_from_flags_and_launch_env(monkeypatch):
    """What the example passes to jax.distributed.initialize, and that jax takes those names."""
    import jax

    mod = _example_module()
    for var in (
        "LAUNCH_COORDINATOR_ADDRESS",
        "LAUNCH_NUM_PROCESSES",
        "LAUNCH_PROCESS_ID",
        "LAUNCH_LOCAL_RANK",
    ):
        monkeypatch.delenv(var, raising=False)
    assert mod.parse_args([]).distributed_kw is None
    by_hand = mod.parse_args(
        [
            "--coordinator",
            "h:1",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--init-timeout",
            "7",
            "--heartbeat-timeout",
            "9",
        ]
    ).distributed_kw
    # By hand, jax's cluster detection is off: under srun it would pick one GPU per process.
    assert by_hand == {
        "coordinator_address": "h:1",
        "num_processes": 2,
        "process_id": 1,
        "cluster_detection_method": "deactivate",
        "initialization_timeout": 7,
        "heartbeat_timeout_seconds": 9,
    }
    assert mod.parse_args(["--distributed"]).distributed_kw == {}  # jax detects the cluster
    assert mod.parse_args(["--distributed", "--coordinator", "h:2"]).distributed_kw == {
        "coordinator_address": "h:2"
    }
    monkeypatch.setenv("LAUNCH_COORDINATOR_ADDRESS", "127.0.0.1:5")
    monkeypatch.setenv("LAUNCH_NUM_PROCESSES", "4")
    monkeypatch.setenv("LAUNCH_PROCESS_ID", "3")
    monkeypatch.setenv("LAUNCH_LOCAL_RANK", "3")
    assert mod.parse_args(["--init-timeout", "30"]).distributed_kw == {
        "coordinator_address": "127.0.0.1:5",
        "num_processes": 4,
        "process_id": 3,
        "local_device_ids": [3],
        "initialization_timeout": 30,
    }
    params = inspect.signature(jax.distributed.initialize).parameters
    assert set(by_hand) <= set(params) and "local_device_ids" in params, sorted(params)


@pytest.mark.parametrize(
    "argv,xla_flags,count",
    [
        ([], "", "4"),
        ([], "--xla_force_host_platform_device_count=2", "2"),
        (["--cpu-devices", "8"], "--xla_force_host_platform_device_count=2 --xla_cpu_foo=1", "8"),
    ],
)
def test_cpu_devices_flag_replaces_the_count_in_xla_flags(monkeypatch, argv, xla_flags, count):
    mod = _example_module()
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    mod._common.prepare_environment(mod.parse_args(argv))
    flags = os.environ["XLA_FLAGS"].split()
    assert [f for f in flags if "device_count" in f] == [f"--xla_force_host_platform_device_count={count}"]
    assert ("--xla_cpu_foo=1" in flags) == ("--xla_cpu_foo=1" in xla_flags)


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--hidden", "30"], "error: --hidden (30) must be divisible by --heads (4)"),
        (["--batch", "3", "--dp", "2"], "error: --batch (3) must be divisible by --dp (2)"),
    ],
    ids=["hidden-heads", "batch-dp"],
)
def test_divisibility_errors_name_the_condition_and_the_values(argv, line):
    """Each of the two conditions has its own message with the values (it was one message for both)."""
    proc = _run([sys.executable, str(SCRIPT), "--steps", "3", *argv], timeout=90)
    assert proc.returncode == 2, _describe(proc)
    assert proc.stderr.strip().splitlines()[-1] == line, _describe(proc)


def test_a_venv_in_the_checkout_is_ignored_by_git():
    """README's install from a checkout may create venv/ in it: git status stays clean of it."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("venv/bin/python", ".venv/bin/python"):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, check=False)
        assert proc.returncode == 0, f"{path} is not ignored by .gitignore"


def test_srun_commands_in_the_docs_do_not_bind_gpus_per_task():
    """jax's Slurm detection gives task i of a node GPU i of those it sees: with --gpus-per-task=1
    each task sees one GPU, so local ranks >= 1 fail (jax-ml/jax#23452), and CUDA IPC between tasks
    is blocked. The documented srun lines ask for GPUs per node, and kill the step on a failure."""
    docs = REPO / "docs" / "multi-process.md"
    for doc, required in ((REPO / "examples" / "README.md", True), (docs, True), (REPO / "README.md", False)):
        commands = re.findall(r"^ *srun .*$", doc.read_text(), re.M)
        assert commands or not required, f"{doc}: no srun command"
        for cmd in commands:
            assert "--gpus-per-task" not in cmd and "--gpus-per-node=" in cmd, (doc, cmd)
            assert "--kill-on-bad-exit=1" in cmd, (doc, cmd)


def test_tuning_section_records_with_the_gpu_runs_flags():
    """examples/README.md's tuning steps: recording on a CPU machine must use the GPU run's model
    flags (dtype, sizes, device count), or the shapes are those of the CPU defaults."""
    text = (REPO / "examples" / "README.md").read_text()
    section = text[text.index('### Tuning `method="auto"` for this model') :]
    cmd = re.search(
        r"JAX_UB_RECORD_SHAPES=shapes\.json JAX_PLATFORMS=cpu python examples/train_tp_block\.py"
        r"(?:[^\n]*\\\n)*[^\n]*",
        section,
    )
    assert cmd, section
    argv = cmd.group(0).replace("\\\n", " ").split()
    gpu_defaults = {name: gpu for name, (gpu, _) in _example_module().DEFAULTS.items()}
    for name in ("dtype", "hidden", "heads", "seq", "batch", "layers"):  # what the shapes depend on
        value = str(gpu_defaults[name])
        assert argv[argv.index(f"--{name}") + 1] == value, (f"the GPU default: --{name} {value}", argv)
    assert "--cpu-devices" in argv


def _gloo_reason() -> str | None:
    if shutil.which("timeout") is None:
        return "coreutils `timeout` is not installed"
    probe = (
        "import jax\n"
        "from jax._src.lib import _jax\n"
        "assert hasattr(_jax, 'make_gloo_tcp_collectives'), 'no make_gloo_tcp_collectives'\n"
        "jax.config.update('jax_cpu_collectives_implementation', 'gloo')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, timeout=60
    )
    if proc.returncode:
        return f"this jaxlib has no gloo CPU collectives: {proc.stderr.strip().splitlines()[-1:]}"
    bash = subprocess.run(
        ["bash", "-c", "wait -n -p x 2>/dev/null; echo $?"], capture_output=True, text=True, check=False
    )
    if bash.stdout.strip() not in ("0", "127"):
        return "launch.sh needs bash >= 5.1 (`wait -n -p`)"
    return None


def test_launch_sh_two_processes():
    reason = _gloo_reason()
    if reason:
        pytest.skip(reason)
    proc = _run(
        [
            "bash",
            str(LAUNCH),
            "2",
            str(SCRIPT),
            "--cpu-devices",
            "2",
            "--steps",
            "12",
            "--log-every",
            "4",
            *TINY,
        ],
        timeout=110,
        LAUNCH_TIMEOUT="100",
    )
    assert proc.returncode == 0, _describe(proc)
    out = proc.stdout
    assert "[rank 0] devices: 4 x cpu in 2 process(es); mesh dp=1 tp=4" in out, _describe(proc)
    assert "[rank 0] [run] path: method='auto' -> 'xla'" in out
    assert "[rank 0] OK" in out
    assert "[rank 1] step" not in out and "[rank 1] OK" not in out  # only process 0 reports
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_by_hand_processes_may_name_the_coordinator_differently():
    """Two processes started by hand (cluster detection off) with flags that may differ between
    processes (the coordinator's spelling, --log-every, the timeouts) run together; the flags that
    must not differ are compared as typed, before the GPU/CPU defaults fill the rest in."""
    reason = _gloo_reason()
    if reason:
        pytest.skip(reason)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    per_process = [
        ["--coordinator", f"127.0.0.1:{port}", "--log-every", "4"],
        ["--coordinator", f"localhost:{port}", "--log-every", "6", "--init-timeout", "90"],
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                *flags,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--cpu-devices",
                "2",
                "--steps",
                "12",
                *TINY,
            ],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i, flags in enumerate(per_process)
    ]
    try:
        outs = [p.communicate(timeout=110) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"exit {p.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert "devices: 4 x cpu in 2 process(es); mesh dp=1 tp=4" in outs[0][0] and "OK" in outs[0][0]
    assert len(_losses(outs[0][0])) == 4  # process 0's --log-every 4


def _launch_bounded(
    argv: list[str], limit: float, **env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs launch.sh; past `limit` seconds it gets SIGTERM (its trap stops its processes: each
    runs under timeout(1), in a process group of its own), then its process group SIGKILL. Returns
    the result (returncode None: it ran past the limit) and the seconds it took."""
    env.setdefault("LAUNCH_TIMEOUT", "90")  # the processes' own bound, should all else fail
    t0 = time.monotonic()
    with subprocess.Popen(
        ["bash", str(LAUNCH), *argv],
        cwd=REPO,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=limit)
            code = child.returncode
        except subprocess.TimeoutExpired:
            code = None
            child.terminate()
            try:
                out, err = child.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                out, err = child.communicate()
    return subprocess.CompletedProcess(child.args, code, out, err), time.monotonic() - t0


# Process 1 of train_tp_block.py fails: a configuration error (exit status 2) or an exception.
_FAIL_ON_ONE = """import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("train_tp_block", {script!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
run = mod._run
def failing_run(args):
    if os.environ["LAUNCH_PROCESS_ID"] == "1":
        if {how!r} == "raise":
            raise RuntimeError("injected failure on process 1")
        if {how!r} == "status":
            args.tp = 3  # dp * tp != the 4 devices
    return run(args)
mod._run = failing_run
if os.environ["LAUNCH_PROCESS_ID"] == "1" and {how!r} == "seed":
    sys.argv += ["--seed", "1"]  # started otherwise than process 0
sys.exit(mod.main())
"""

# jax's limit on the failed process's exit-time jax.distributed.shutdown() barrier is 300 s; before
# the fix, the failed rank stayed in it until its peer gave up (about 40 s on CPU) or ended.
FAIL_FAST_LIMIT = 25.0


_BAD_TP = "dp (1) * tp (3) must equal the device count (4)"
_SEED = "process 1: seed=1 (process 0: 0)"


@pytest.mark.parametrize(
    "how,status,lines",
    [
        # Process 1 says its own problem; process 0 says which process cannot go on, and why.
        (
            "status",
            2,
            [
                f"[rank 1] error: {_BAD_TP}",
                "[rank 0] error: jax_ub.check_processes: 1 of 2 processes cannot go on: "
                f"process 1: {_BAD_TP}",
            ],
        ),
        (
            "seed",
            2,
            [
                "[rank 0] error: jax_ub.check_processes: the 2 processes disagree; every process must "
                "be started with the same settings. 1 process differs from process 0:",
                f"[rank 0]   {_SEED}",
                f"[rank 1]   {_SEED}",
            ],
        ),
        ("raise", 1, ["[rank 1] RuntimeError: injected failure on process 1"]),
    ],
)
def test_launch_sh_example_failing_on_one_rank_ends_fast(tmp_path, how, status, lines):
    """A failed process of the example leaves with os._exit (not through jax's atexit shutdown
    barrier), so launch.sh sees the failure and stops the other process within its grace period.
    A configuration that process 1 cannot run, or flags that differ from process 0's, stop both
    processes themselves, each naming process 1 and why (jax_ub.check_processes), before any
    collective. LAUNCH_FAIL_FAST=0: the example's own handling, not launch.sh's failfast.py
    wrapper."""
    reason = _gloo_reason()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "fail_on_one.py"
    script.write_text(_FAIL_ON_ONE.format(script=str(SCRIPT), how=how))
    proc, took = _launch_bounded(
        ["2", str(script), "--cpu-devices", "2", "--steps", "20", *TINY],
        FAIL_FAST_LIMIT,
        LAUNCH_FAIL_FAST="0",
        LAUNCH_GRACE="1",
        LAUNCH_KILL_AFTER="1",
    )
    assert proc.returncode == status, f"{took:.1f} s\n{_describe(proc)}"
    assert took < FAIL_FAST_LIMIT
    for line in lines:
        assert line in proc.stderr, _describe(proc)
    if how == "raise":
        assert re.search(rf"launch.sh: rank 1 \(pid \d+\) exited with status {status}", proc.stderr)
    else:  # both stop by themselves, with status 2 (not launch.sh's SIGTERM or SIGKILL)
        assert "Traceback" not in proc.stderr, _describe(proc)
        assert "[rank 0] error:" in proc.stderr and "[rank 1] error:" in proc.stderr, _describe(proc)
        assert re.search(r"launch.sh: rank [01] \(pid \d+\) exited with status 2", proc.stderr)


_RAISE_ON_ONE = """import os, time
import jax
jax.distributed.initialize(os.environ["LAUNCH_COORDINATOR_ADDRESS"], int(os.environ["LAUNCH_NUM_PROCESSES"]),
                           int(os.environ["LAUNCH_PROCESS_ID"]))
if jax.process_index() == 1:
    raise RuntimeError("process 1 failed")
time.sleep(120)
"""


def test_launch_sh_stops_a_plain_script_that_raises_on_one_rank(tmp_path):
    """A user's script that raises after jax.distributed.initialize() (no os._exit of its own):
    launch.sh runs it through examples/failfast.py, so the failure ends the process and its peer
    is stopped; without that, the failed process waited in jax's shutdown barrier until its peer's
    120 s sleep ended."""
    if shutil.which("timeout") is None:
        pytest.skip("coreutils `timeout` is not installed")
    script = tmp_path / "raise_on_one.py"
    script.write_text(_RAISE_ON_ONE)
    proc, took = _launch_bounded(["2", str(script)], FAIL_FAST_LIMIT, LAUNCH_GRACE="1", LAUNCH_KILL_AFTER="1")
    assert proc.returncode == 1, f"{took:.1f} s\n{_describe(proc)}"
    assert "[rank 1] RuntimeError: process 1 failed" in proc.stderr, _describe(proc)
    assert "failfast.py" not in proc.stderr, _describe(proc)  # the traceback is the script's own


def test_launch_sh_returns_when_its_processes_have_ended():
    """After a failure, the grace timer's sleep used to keep launch.sh's stdout/stderr open, so a
    caller reading them waited the whole grace period after every process had ended."""
    if shutil.which("timeout") is None:
        pytest.skip("coreutils `timeout` is not installed")
    code = "import os, sys, time\nsys.exit(3) if os.environ['LAUNCH_PROCESS_ID'] == '1' else time.sleep(0.5)"
    t0 = time.monotonic()
    proc = _run(["bash", str(LAUNCH), "2", "-c", code], timeout=60, LAUNCH_GRACE="30")
    took = time.monotonic() - t0
    assert proc.returncode == 3, _describe(proc)
    assert took < 15, f"{took:.1f} s: waited for the {30} s grace timer"


@pytest.mark.parametrize(
    "mode,status,atexit_ran",
    [("ok", 0, True), ("exit0", 0, True), ("exit3", 3, False), ("raise", 1, False), ("message", 1, False)],
)
def test_failfast_wrapper_exit_status_and_atexit(tmp_path, mode, status, atexit_ran):
    """examples/failfast.py runs a script as `python script.py` would (argv, sys.path[0], __main__),
    and skips the atexit handlers (jax's jax.distributed.shutdown() barrier among them) only when
    the script fails."""
    script = tmp_path / "prog.py"
    script.write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "print(__name__, sys.argv[1:], sys.path[0] == os.path.dirname(os.path.realpath(__file__)))\n"
        "mode = sys.argv[1]\n"
        "if mode == 'exit0': sys.exit(0)\n"
        "if mode == 'exit3': sys.exit(3)\n"
        "if mode == 'raise': raise ValueError('bad')\n"
        "if mode == 'message': sys.exit('a message')\n"
    )
    proc = _run([sys.executable, str(FAILFAST), str(script), mode, "x"], timeout=60)
    assert proc.returncode == status, _describe(proc)
    assert proc.stdout.startswith(f"__main__ ['{mode}', 'x'] True\n"), _describe(proc)
    assert ("atexit ran" in proc.stdout) == atexit_ran, _describe(proc)
    if mode == "raise":
        assert proc.stderr.endswith("ValueError: bad\n") and "failfast.py" not in proc.stderr, proc.stderr
    if mode == "message":
        assert proc.stderr == "a message\n", proc.stderr


def test_readme_quick_start_runs_on_cpu(tmp_path):
    """The README's Quick start blocks as they stand (the shard_map one, then the NNX one): on CPU,
    initialize is a no-op and the reference runs."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start\n") :]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    want = ["xla-reference (1024, 512) xla: ", "(8, 256, 512) P(None, 'tp', None)\n"]
    assert len(blocks) == len(want), blocks
    for i, (code, out) in enumerate(zip(blocks, want, strict=True)):
        script = tmp_path / f"quick_start_{i}.py"
        script.write_text(code)
        for extra in ({}, {"JAX_UB_DISABLE": "1"}):
            env = _env(**extra)  # which drops a device count from XLA_FLAGS: the README's 4 devices
            env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
            proc = subprocess.run(
                [sys.executable, str(script)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert proc.stdout.startswith(out), (i, proc.stdout)


def test_loss_check_judges_only_runs_long_enough():
    """A short run (e.g. one that only records shapes for bench tune) is checked for a finite loss
    only; from JUDGE_STEPS steps on, a loss that does not decrease fails the run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tp_block", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rising = [4.0 + 0.1 * i for i in range(mod.JUDGE_STEPS)]
    assert mod._check(rising[: mod.JUDGE_STEPS - 1], "run") is None
    assert "did not decrease" in mod._check(rising, "run")
    assert mod._check(rising[::-1], "run") is None
    assert "not finite" in mod._check([4.0, float("nan")], "run")
    # noise is not learning: a loss that wanders down by 2% (as an untrained model's does) fails
    flat = [4.7, 4.6, 4.7, 4.65, 4.62, 4.68, 4.6, 4.64, 4.61, 4.6]
    assert "did not decrease by 5%" in mod._check(flat, "run")


def test_failfast_runs_code_and_refuses_a_missing_script_as_python_does(tmp_path):
    """-c CODE as `python -c` (so launch.sh can run it through failfast.py too); a script that does
    not exist exits 2 with python's own words, not 1 with a traceback."""
    failfast = str(FAILFAST)
    code = (
        "import atexit, sys\natexit.register(lambda: print('atexit ran'))\n"
        "print(__name__, sys.argv)\nsys.exit(3)"
    )
    proc = _run([sys.executable, failfast, "-c", code, "a", "b"], timeout=30)
    assert proc.returncode == 3 and proc.stdout.splitlines() == ["__main__ ['-c', 'a', 'b']"], _describe(proc)
    proc = _run([sys.executable, failfast, str(tmp_path / "missing.py")], timeout=30)
    assert proc.returncode == 2 and "can't open file" in proc.stderr and "Traceback" not in proc.stderr, (
        _describe(proc)
    )


def test_launch_sh_refuses_what_it_would_misrun():
    """An interpreter option in the script's place (failfast.py was silently skipped, so a failure
    took jax's shutdown timeout to end) and a LAUNCH_TIMEOUT that is not seconds (timeout(1) failed
    every rank with status 125): exit 2 naming the problem; PYTHON may carry the options."""
    if shutil.which("timeout") is None:
        pytest.skip("coreutils `timeout` is not installed")
    hello = "import os; print('hi', os.environ['LAUNCH_PROCESS_ID'])"
    proc = _run(["bash", str(LAUNCH), "2", "-u", "-c", hello], timeout=60)
    assert (
        proc.returncode == 2
        and "'-u' is an interpreter option; put it and its value in PYTHON" in proc.stderr
    ), _describe(proc)
    proc = _run(["bash", str(LAUNCH), "2", "-c", hello], timeout=60, LAUNCH_TIMEOUT="abc")
    assert proc.returncode == 2 and "LAUNCH_TIMEOUT must be seconds; got 'abc'" in proc.stderr, _describe(
        proc
    )
    proc = _run(["bash", str(LAUNCH), "2", "-c", hello], timeout=60, PYTHON=f"{sys.executable} -u")
    assert proc.returncode == 0 and "[rank 1] hi 1" in proc.stdout, _describe(proc)


def test_distributed_with_no_cluster_to_detect_is_a_configuration_error():
    """--distributed in a plain shell: jax's ValueError ("coordinator_address should be defined")
    was a traceback and exit 1; now one error line, exit 2, saying what to pass instead."""
    if any(k.startswith(("SLURM_", "OMPI_")) for k in os.environ):
        pytest.skip("a cluster environment is set here: --distributed would detect it")
    proc = _run([sys.executable, str(SCRIPT), "--distributed", "--steps", "3", *TINY], timeout=90)
    assert proc.returncode == 2, _describe(proc)
    assert "error: jax.distributed.initialize() refused: " in proc.stderr, _describe(proc)
    assert (
        "--distributed found no mpirun or srun environment: pass --coordinator, --num-processes and "
        "--process-id"
        in proc.stderr
        and "Traceback" not in proc.stderr
    ), _describe(proc)


@pytest.mark.parametrize("script", [LLAMA, SCRIPT], ids=["llama", "tp_block"])
def test_examples_answer_their_options_from_any_folder(script, tmp_path):
    """Run by path from another folder (examples/_common.py is found next to the script): --help
    names the GPU and the CPU default of the sizes, and a count below one is refused before jax
    starts."""

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(script), *argv]
        return subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)

    proc = run("--help")
    assert proc.returncode == 0, _describe(proc)
    assert re.search(r"training steps \(default: \d+ on GPU, \d+ on CPU\)", " ".join(proc.stdout.split()))
    proc = run("--batch", "0")
    assert proc.returncode == 2 and "error: --batch must be >= 1; got 0" in proc.stderr, _describe(proc)
    assert proc.stdout == "", _describe(proc)
