"""The delayed-scaling update kernel (pallas_kernels/fp8_cast/history.py) against te_jax.fp8.quantize.delayed_update
(itself checked against a numpy model of TransformerEngine's rule in test_fp8.py), and its argument checks.
The fused FP8 paths that run it are compared with the unfused path, state included, in test_fp8_fused_mlp.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_cast.history import MAX_HISTORY, delayed_update_many
from te_jax.fp8 import quantize as Q

E4M3, E5M2 = 448.0, 57344.0


def _on_gpu():
    return jax.default_backend() == "gpu"


@pytest.mark.parametrize("length", [1, 2, 5, 1024])
@pytest.mark.parametrize("algo,margin", [("max", 0), ("max", 2), ("most_recent", 1)])
def test_kernel_equals_delayed_update(length, algo, margin):
    """Six tensors in one launch, with this step's amax ordinary, larger than the whole history, zero, NaN, inf and
    so small that fmax / amax overflows: the next scales and histories are delayed_update's (histories exactly;
    scales exactly in interpret mode, within one ulp compiled)."""
    rng = np.random.default_rng(length + margin)
    hists = [jnp.asarray(rng.uniform(0.0, 5.0, length), jnp.float32) for _ in range(6)]
    scales = [jnp.float32(s) for s in rng.uniform(0.5, 4.0, 6)]
    scales[1] = scales[1].reshape(1)  # a (1,) scale as the state holds it
    amaxes = [jnp.float32(a) for a in (3.0, 80.0, 0.0, np.nan, np.inf, 1e-45)]
    fmaxes = [E4M3, E5M2, E4M3, E4M3, E5M2, E4M3]
    got_s, got_h = delayed_update_many(hists, scales, amaxes, fmaxes, margin=margin, algo=algo,
                                       interpret=None if _on_gpu() else True)
    for i in range(6):
        want_s, want_h = Q.delayed_update(hists[i], scales[i], amaxes[i], fmaxes[i], margin, algo)
        np.testing.assert_array_equal(np.asarray(got_h[i]), np.asarray(want_h))
        assert got_s[i].shape == (1,) and got_s[i].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got_s[i]), np.asarray(want_s).reshape(1), rtol=2.4e-7 if _on_gpu() else 0)
    # the cases do what the rule says: NaN / inf are recorded as 0 and keep the scale; a zero window keeps it
    assert float(got_h[3][-1]) == 0.0 and float(got_s[3][0]) == float(scales[3])
    assert float(got_s[4][0]) == float(scales[4])
    if length == 1 or algo == "most_recent":
        assert float(got_s[2][0]) == float(scales[2])  # window 0
        assert float(got_s[5][0]) == float(scales[5])  # fmax / 1e-45 is inf


def test_kernel_under_jit_and_vmap():
    """Traced arguments (a jitted step) and a vmapped batch of states (nn.vmap / scan over layers may batch them)."""
    hists = jnp.abs(jax.random.normal(jax.random.key(0), (3, 16)))
    amaxes = jnp.array([1.0, 2.0, 7.0], jnp.float32)
    scales = jnp.ones((3,), jnp.float32)
    interpret = None if _on_gpu() else True
    f = jax.jit(jax.vmap(lambda h, s, a: delayed_update_many([h], [s], [a], [E4M3], interpret=interpret)))
    got_s, got_h = f(hists, scales, amaxes)
    for i in range(3):
        want_s, want_h = Q.delayed_update(hists[i], scales[i], amaxes[i], E4M3)
        np.testing.assert_array_equal(np.asarray(got_h[0][i]), np.asarray(want_h))
        np.testing.assert_allclose(np.asarray(got_s[0][i]), np.asarray(want_s).reshape(1), rtol=2.4e-7)


def test_kernel_refuses_what_it_does_not_take():
    h = jnp.zeros((4,), jnp.float32)
    one = jnp.float32(1.0)
    with pytest.raises(ValueError, match="the same number"):
        delayed_update_many([h, h], [one], [one, one], [E4M3, E4M3])
    with pytest.raises(ValueError, match=r"one shape \[L\]"):
        delayed_update_many([h, jnp.zeros((5,))], [one, one], [one, one], [E4M3, E4M3])
    with pytest.raises(ValueError, match=f"outside \\[1, {MAX_HISTORY}\\]"):
        delayed_update_many([jnp.zeros((MAX_HISTORY + 1,))], [one], [one], [E4M3])
    with pytest.raises(ValueError, match=r"amaxes holds an array of shape \(2,\)"):
        delayed_update_many([h], [one], [jnp.ones((2,))], [E4M3])
    with pytest.raises(ValueError, match="algo='mean'"):
        delayed_update_many([h], [one], [one], [E4M3], algo="mean")


def test_fused_path_takes_the_kernel_and_the_switch_turns_it_off(monkeypatch):
    """Under TE_JAX_FP8_FUSED=1 a fused delayed-scaling GEMM's step has one state-update kernel per pass (forward:
    input and kernel histories; backward: the output gradient's) and TE_JAX_FP8_STATE_KERNEL=0 none, with equal
    next states."""
    from te_jax.fp8.recipe import DelayedScaling

    monkeypatch.setenv("TE_JAX_FP8_FUSED", "1")
    recipe = DelayedScaling(amax_history_len=4)
    x = jax.random.normal(jax.random.key(1), (32, 64), jnp.bfloat16)
    w = 0.1 * jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)
    dn = (((1,), (0,)), ((), ()))

    def run(setting):
        monkeypatch.setenv("TE_JAX_FP8_STATE_KERNEL", setting)

        def step(state):  # a new function per setting: jit caches a traced function with what it read
            f = lambda x, w, s: jnp.sum(Q.fp8_dot_general(x, w, dn, recipe, s).astype(jnp.float32))  # noqa: E731
            return jax.grad(f, argnums=2)(x, w, state)

        text = str(jax.make_jaxpr(step)(Q.init_state(4)))
        state = Q.init_state(4)
        for _ in range(2):
            state = jax.jit(step)(state)
        return text.count("fp8_delayed_update"), state

    n_off, off = run("0")
    n_on, on = run("1")
    assert n_on >= 2 and n_off == 0, (n_on, n_off)
    for k in Q.STATE_KEYS:
        np.testing.assert_array_equal(np.asarray(on[k]), np.asarray(off[k]), err_msg=k)
    assert float(on["output_grad_amax_history"][-1]) > 0 and float(on["kernel_scale"][0]) != 1.0
