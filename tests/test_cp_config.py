"""context_parallel_attention(config=...): the kernel configuration reaches the pallas kernels on every ring step,
and the result still equals single-device attention (forward and gradients)."""
import jax
import numpy as np
import pytest

import te_jax
from helpers import cpu_mesh, qkv, spy_kernel_configs


def test_cp_config_reaches_the_kernel(monkeypatch):
    seen, cfg = spy_kernel_configs(monkeypatch, "flash_attention_fwd", "flash_attention_bwd")
    mesh = cpu_mesh((2,), ("cp",))
    q, k, v, ct = qkv(0, 1, 32, 32, 2, 2, 16, cotangent=True)

    def f(q, k, v):
        return te_jax.context_parallel_attention(q, k, v, cp_axis="cp", mesh=mesh, attn_mask_type="causal",
                                                 load_balanced=False, backend="pallas", config=cfg)

    out, grads = jax.jit(lambda q, k, v: (lambda o, vjp: (o, vjp(ct)))(*jax.vjp(f, q, k, v)))(q, k, v)
    assert seen and all(bs == cfg for _, bs in seen), seen
    assert {n for n, _ in seen} == {"flash_attention_fwd", "flash_attention_bwd"}

    def ref(q, k, v):
        return te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="xla")

    rout, rgrads = jax.jit(lambda q, k, v: (lambda o, vjp: (o, vjp(ct)))(*jax.vjp(ref, q, k, v)))(q, k, v)
    np.testing.assert_allclose(out, rout, atol=2e-5, rtol=2e-5)
    for a, b in zip(grads, rgrads):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5)
    choice = te_jax.explain_context_parallel_backend(q, k, v, cp_axis="cp", mesh=mesh, backend="pallas", config=cfg)
    assert "takes no kernel configuration" in choice.reasons["xla"]
    with pytest.raises(ValueError, match="^config: got dict"):
        jax.jit(lambda q: te_jax.context_parallel_attention(q, q, q, cp_axis="cp", mesh=mesh,
                                                            config={"block_q": 16}))(q)
