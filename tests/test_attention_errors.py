"""Bad calls to dot_product_attention raise ValueError naming the argument, the shapes and the fix."""
import jax.numpy as jnp
import pytest

import te_jax

B, S, H, G, D = 2, 8, 4, 2, 16
q4, k4, v4 = jnp.ones((B, S, H, D)), jnp.ones((B, S, G, D)), jnp.ones((B, S, G, D))


def call(q=q4, k=k4, v=v4, **kw):
    return te_jax.dot_product_attention(q, k, v, backend="xla", **kw)


BAD = [
    ("no head axis", dict(q=jnp.ones((B, S, H * D))), ["query", "rank-4", "(2, 8, 64)", "no head axis"]),
    ("thd given 4-d", dict(attn_input_format="thd", attn_mask_type="padding",
                           q_seqlens=jnp.array([8])), ["query", "'thd'", "rank-3"]),
    ("unknown format", dict(attn_input_format="bhsd"), ["attn_input_format='bhsd'", "bshd"]),
    ("heads do not divide", dict(k=jnp.ones((B, S, 3, D)), v=jnp.ones((B, S, 3, D))),
     ["query heads (4)", "key/value heads (3)"]),
    ("batch mismatch", dict(k=jnp.ones((3, S, G, D)), v=jnp.ones((3, S, G, D))), ["batch sizes differ"]),
    ("head_dim mismatch", dict(k=jnp.ones((B, S, G, 8)), v=jnp.ones((B, S, G, 8))), ["same head_dim"]),
    ("k/v length mismatch", dict(v=jnp.ones((B, 5, G, D))), ["same sequence length"]),
    ("k/v heads mismatch", dict(v=jnp.ones((B, S, 1, D))), ["same number of heads"]),
    ("dtype mix", dict(k=k4.astype(jnp.bfloat16)), ["dtypes differ", "astype"]),
    ("int dtype", dict(q=q4.astype(jnp.int32), k=k4.astype(jnp.int32), v=v4.astype(jnp.int32)), ["int32"]),
    ("unknown mask", dict(attn_mask_type="causal_top_left"), ["attn_mask_type='causal_top_left'"]),
    ("seqlens without padding mask", dict(q_seqlens=jnp.array([4, 8])), ["padding_causal"]),
    ("padding mask without lengths", dict(attn_mask_type="padding"), ["q_seqlens"]),
    ("seqlens wrong shape", dict(attn_mask_type="padding", q_seqlens=jnp.array([4, 8, 2]),
                                 kv_seqlens=jnp.array([4, 8])), ["q_seqlens", "(3,)", "(2,)"]),
    ("seqlens too long", dict(attn_mask_type="padding", q_seqlens=jnp.array([4, 9]),
                              kv_seqlens=jnp.array([4, 8])), ["q_seqlens", "[0, 8]"]),
    ("segment ids wrong shape", dict(attn_mask_type="padding", q_segment_ids=jnp.ones((B, 7), jnp.int32),
                                     kv_segment_ids=jnp.ones((B, S), jnp.int32)), ["q_segment_ids", "(2, 7)"]),
    ("both lengths and segments", dict(attn_mask_type="padding", q_seqlens=jnp.array([4, 8]),
                                       q_segment_ids=jnp.ones((B, S), jnp.int32)), ["either"]),
    ("window negative", dict(window_size=(-2, 0)), ["left=-2", "-1"]),
    ("window not a pair", dict(window_size=5), ["pair (left, right)"]),
    ("window right with causal", dict(attn_mask_type="causal", window_size=(3, 2)), ["right=2", "causal"]),
    ("bias wrong shape", dict(bias=jnp.ones((B, H, S, S + 1))), ["bias", "(2, 4, 8, 9)", "[2 or 1, 4 or 1, 8, 8]"]),
    ("bias rank 2", dict(bias=jnp.ones((S, S))), ["bias", "(8, 8)"]),
    ("softcap zero", dict(softcap=0.0), ["softcap"]),
    ("dropout without rng", dict(dropout_rate=0.1), ["dropout_rng"]),
    ("dropout rate 1", dict(dropout_rate=1.0), ["[0, 1)"]),
    ("scale nan", dict(scale=float("nan")), ["scale"]),
    ("thd without segments", dict(q=jnp.ones((S, H, D)), k=jnp.ones((S, G, D)), v=jnp.ones((S, G, D)),
                                  attn_input_format="thd"), ["thd", "q_seqlens"]),
    ("thd seqlens overflow", dict(q=jnp.ones((S, H, D)), k=jnp.ones((S, G, D)), v=jnp.ones((S, G, D)),
                                  attn_input_format="thd", attn_mask_type="padding",
                                  q_seqlens=jnp.array([5, 5]), kv_seqlens=jnp.array([4, 4])), ["sums to 10"]),
]


@pytest.mark.parametrize("name,kwargs,fragments", BAD, ids=[b[0] for b in BAD])
def test_bad_call_message(name, kwargs, fragments):
    with pytest.raises(ValueError) as e:
        call(**kwargs)
    for f in fragments:
        assert f in str(e.value), f"{name}: {f!r} not in {str(e.value)!r}"
