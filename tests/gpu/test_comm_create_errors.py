"""GPU tier: a communicator that cannot be created fails with an error, not a crash.

Every failure of ``Communicator::Create`` before the peers are known (a device ordinal that does
not exist, a kernel image missing for the GPU, a flag allocation that fails) must come back as the
error: the cleanup on that path must not walk per-peer tables that are not sized yet (a SIGSEGV).
The calls run in a child process, so a crash fails this test instead of ending the pytest run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU

CHILD = textwrap.dedent("""
    import jax_ub
    from jax_ub import _ext
    mod = _ext.extension()
    try:
        mod.comm_create(set_id=9001, group=0, rank=0, world=2, device=99, capacity=1 << 20,
                        timeout_s=5.0)
        print("CREATED")
    except Exception as e:
        print("ERROR", type(e).__name__, str(e))
    # The process and its CUDA context stay usable: a communicator on a real device still works
    # up to the point where it needs its peer (world 1 has none).
    mod.comm_create(set_id=9002, group=0, rank=0, world=1, device=0, capacity=1 << 20, timeout_s=5.0)
    mod.comm_destroy_set(9002)
    print("AFTER ok")
""")


def test_communicator_on_a_missing_device_is_an_error_not_a_crash():
    import jax_ub

    if not jax_ub.build_info()["cuda_path"]:
        pytest.fail(f"GPU present but jax_ub's CUDA path is inactive: {jax_ub.build_info()['reason']}")
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"child exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    err = [ln for ln in lines if ln.startswith("ERROR ")]
    assert err, r.stdout
    assert "99" in err[0] and "invalid device" in err[0].lower(), err[0]
    assert "AFTER ok" in lines, r.stdout
