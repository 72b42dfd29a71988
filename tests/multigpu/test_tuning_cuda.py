"""Multi-GPU tier: record a program's shapes, ``bench tune`` them, run ``auto`` from the result.

The program (an AG->GEMM, then a GEMM->RS, differentiated) is traced inside
``jax_ub.tuning.record()``; ``bench tune``'s runner measures every method at the recorded shapes
on the GPUs; with ``JAX_UB_TUNING_FILE`` set to its file, ``auto`` must choose from it (within
choice.TIE of the fastest measured method) and the program must still compute what the reference
computes, forward and gradients. Skips without >= 2 CUDA GPUs.
"""

from __future__ import annotations

import json

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests.multigpu.test_overlap import MAX_TP, _mesh, _n_gpus, _rand, _rel  # noqa: E402

pytestmark = pytest.mark.multigpu  # tests/conftest.py skips it without 2 GPUs


@pytest.fixture(scope="module")
def ub():
    import jax_ub

    yield jax_ub
    jax_ub.shutdown()


def _step(mesh, method):
    import jax_ub

    def body(x, w1, w2):
        h = jax.nn.gelu(jax_ub.all_gather_matmul(x, w1, "tp", method=method))
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", method=method)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp"), P("tp", None)),
        out_specs=P("tp", None),
        check_vma=False,
    )
    loss = lambda x, w1, w2: jnp.sum(f(x, w1, w2).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def test_record_tune_then_auto_runs_from_the_file(ub, tmp_path):
    from jax_ub import choice, config, methods, resolve, tuning
    from jax_ub.bench import __main__ as cli
    from jax_ub.bench import tune

    tp = min(_n_gpus(), MAX_TP)
    M, H, F = 512 * tp, 1024, 4096
    mesh = _mesh(tp)
    x, w1, w2 = (
        _rand(1, (M, H), jnp.bfloat16),
        _rand(2, (H, F), jnp.bfloat16) * 0.05,
        _rand(3, (F, H), jnp.bfloat16) * 0.05,
    )
    ub.initialize(mesh, "tp")
    with tuning.record() as rec:
        _step(mesh, None)[1].lower(x, w1, w2)
    got = {(s["op"], s["M"], s["K"], s["N"], s["role"]) for s in rec.shapes()}
    assert got == {
        ("ag", M, H, F, "forward"),
        ("rs", M, F, H, "backward"),
        ("rs", M, F, H, "forward"),
        ("ag", M, H, F, "backward"),
    }
    shapes = tmp_path / "shapes.json"
    rec.save(str(shapes))
    ub.shutdown()

    a = cli._parser().parse_args(
        [
            "tune",
            str(shapes),
            "--out",
            str(tmp_path / "o"),
            "--machine",
            "t",
            "--warmup",
            "2",
            "--iters",
            "5",
            "--reps",
            "3",
            "--settle-ms",
            "0",
        ]
    )
    a.date = "d"
    assert tune.run(a) == 0
    out = tmp_path / "o" / "t-d-tune.json"
    doc = json.loads(out.read_text())
    assert doc["path"] == "cuda"
    picks = {}
    for op, (m, k, n) in (("ag", (M, H, F)), ("rs", (M, F, H))):
        res = {
            r["impl"]: r["ms"]
            for r in doc["records"]
            if r["op"] == choice.BENCH_OP[op] and (r["M"], r["K"], r["N"]) == (m, k, n)
        }
        cuda_methods = set(methods.SCHEDULES[op])
        assert {f"jax_ub_{x}" for x in cuda_methods} <= set(res), res  # every method ran
        # auto leaves out what sums in bf16 at tp >= 3 (chain) unless JAX_UB_AUTO_CHAIN=1
        fastest = tune.best(
            {
                k: v
                for k, v in res.items()
                if not choice.sums_in_dtype(op, choice.method_of(k) or "", tp, "bfloat16")
            }
        )
        picked = choice.choose(op, tp, "bfloat16", m, k, n, str(out)).method
        ms = res["xla_plain" if picked == "xla" else f"jax_ub_{picked}"]
        assert ms <= fastest[1] * choice.TIE, (op, picked, ms, fastest)
        picks[op] = picked

    ub.initialize(mesh, "tp")
    with config.override(tuning_file=str(out)):
        xs, w1s = x[: M // tp], w1[:, : F // tp]
        assert "your tuning file" in resolve.explain("ag", xs, w1s)
        assert "your tuning file" in resolve.explain(
            "rs", jnp.zeros((M, F // tp), jnp.bfloat16), w2[: F // tp]
        )
        fwd, grad = _step(mesh, None)
        hlo = fwd.lower(x, w1, w2).as_text()
        for op, target in (("ag", "jax_ub_ag_gemm"), ("rs", "jax_ub_gemm_rs")):
            assert (target in hlo) == (picks[op] != "xla"), (op, picks[op])  # auto ran the file's pick
        y, g = fwd(x, w1, w2), grad(x, w1, w2)
    ref_fwd, ref_grad = _step(mesh, "xla")
    f32 = [v.astype(jnp.float32) for v in (x, w1, w2)]
    assert _rel(y, ref_fwd(*f32)) < 2e-2
    for a_, b_ in zip(g, ref_grad(*f32), strict=True):
        assert _rel(a_, b_) < 2e-2


def test_chained_bench_program_keeps_every_op(ub):
    """bench --chain N (tune's default 8): after XLA's GPU passes the program still holds N ops of
    each impl, jax_ub's custom call and XLA's all-gather and dot alike (none merged or dropped)."""
    from jax import lax

    from jax_ub.bench import harness

    tp, n = 2, 4
    mesh = _mesh(tp)
    ub.initialize(mesh, "tp")
    x, w = _rand(4, (256 * tp, 512), jnp.bfloat16), _rand(5, (512, 256 * tp), jnp.bfloat16)

    def smap(f):
        return jax.jit(
            jax.shard_map(
                f,
                mesh=mesh,
                in_specs=(P("tp", None), P(None, "tp")),
                out_specs=P(None, "tp"),
                check_vma=False,
            )
        )

    ours = harness.chain_fn(smap(lambda x, w: ub.all_gather_matmul(x, w, "tp", method="push")), n)
    xla = harness.chain_fn(smap(lambda x, w: lax.all_gather(x, "tp", tiled=True) @ w), n)
    hlo_ours = ours.lower(x, w).compile().as_text()
    hlo_xla = xla.lower(x, w).compile().as_text()
    import re

    ours_n = hlo_ours.count('custom_call_target="jax_ub_ag_gemm"')
    xla_n = len(re.findall(r"[^%\w.-]all-gather(?:-start)?\(", hlo_xla))  # the opcode, not a %name
    assert (ours_n, xla_n) == (n, n), [ln for ln in hlo_xla.splitlines() if "all-gather" in ln][:12]
    want = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32))
    for y in (*ours(x, w), *xla(x, w)):
        assert _rel(y, want) < 1e-2
    ub.shutdown()
