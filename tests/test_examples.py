"""The training example (examples/train_lm.py) on the CPU: tiny model, few steps.

- loss falls, a checkpoint/resume continues with the same steps and losses as an uninterrupted run,
  the KV-cache sample and the loss plot are produced;
- the multi-device mesh (8 fake CPU devices from conftest: data × context [× tensor], context-parallel
  attention with zig-zag load balancing) gives the losses of the single-device run (fp32).
"""
import importlib.util
import math
import os
import subprocess
import sys

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")


def _load():
    spec = importlib.util.spec_from_file_location("train_lm_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses (the Flax module) look their module up by name
    spec.loader.exec_module(mod)
    return mod


train_lm = _load()

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq-len", "32", "--batch", "4",
        "--lr", "1e-2", "--warmup", "2", "--eval-batches", "1", "--eval-every", "0", "--log-every", "1",
        "--no-progress", "--dtype", "fp32", "--no-compile-cache"]


def _run(tmp_path, *extra):
    return train_lm.main(TINY + ["--out-dir", str(tmp_path)] + list(extra))


def test_loss_falls_and_resume_matches_uninterrupted_run(tmp_path):
    full = _run(tmp_path / "full", "--steps", "8", "--sample-len", "12", "--prompt", "def ")
    losses = [full["losses"][s] for s in range(1, 9)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] > 5.0  # ~ln(256) at initialisation
    assert max(losses[-2:]) < losses[0] - 0.5, losses
    assert math.isfinite(full["eval_loss"]) and full["eval_loss"] < losses[0]
    assert full["sample"].startswith("def ") and len(full["sample"].encode("utf-8", "replace")) >= 4
    assert os.path.isfile(tmp_path / "full" / "loss.png")

    # KV-cache decoding (greedy) gives the tokens of full forward passes over the growing sequence
    args = train_lm.parse_args(TINY)
    greedy = train_lm.generate(args, full["params"], "def ", 5, seed=0, temperature=0.0)
    model = train_lm.make_model(args)
    # full forward passes (no cache) over the growing sequence, zero-filled to one shape (one compile): the
    # model is causal, so the logits at the last real token see only the real tokens before it
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x, jnp.arange(9)[None]))
    ids = list(b"def ")
    for _ in range(5):
        x = jnp.asarray([ids + [0] * (9 - len(ids))], jnp.int32)
        logits = forward(full["params"], x)
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    assert len(ids) == 9 and greedy == bytes(ids).decode("utf-8", errors="replace"), (greedy, bytes(ids))

    first = _run(tmp_path / "split", "--steps", "8", "--stop-after", "4", "--sample-len", "0", "--no-plot")
    assert sorted(first["losses"]) == [1, 2, 3, 4]
    np.testing.assert_allclose([first["losses"][s] for s in range(1, 5)], losses[:4], rtol=1e-6)
    resumed = _run(tmp_path / "split", "--steps", "8", "--resume", "--sample-len", "0", "--no-plot")
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]  # continues at the checkpoint's step
    assert resumed["step"] == 8
    np.testing.assert_allclose([resumed["losses"][s] for s in range(5, 9)], losses[4:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resumed["eval_loss"], full["eval_loss"], rtol=1e-5)
    assert [h[0] for h in resumed["history"]["train"]] == list(range(1, 9))  # history carried over
    # a new run into a directory that holds one is refused before it trains (it used to fail saving at its end)
    with pytest.raises(FileExistsError, match=r"already holds a run's checkpoints \(latest step 8\).*--resume"):
        _run(tmp_path / "split", "--steps", "8", "--sample-len", "0", "--no-plot")
    with pytest.raises(ValueError, match="differs"):  # a checkpoint of another model is refused
        _run(tmp_path / "split", "--steps", "9", "--resume", "--hidden", "64", "--sample-len", "0", "--no-plot")


@pytest.mark.parametrize("mesh,extra", [
    ("dp=2,cp=4", []),  # ring, load balanced
    # tp, all-gather CP and sbhd are each checked against one device in the CI suite elsewhere
    # (test_sharded_train_step dp=2,tp=2; test_context_parallel): the example's combination is slow-marked
    pytest.param("dp=2,cp=2,tp=2", ["--attn-input-format", "sbhd", "--cp-strategy", "all_gather", "--gqa-groups",
                                    "2", "--heads", "4", "--untied"], marks=pytest.mark.slow),
    # packed short documents: segment ids and restarting positions, zig-zag reordered, over the ring
    ("dp=2,cp=4", ["--pack", "--data", "SHORT_DOCUMENTS"]),
], ids=["ring", "tp, all-gather, sbhd", "ring, packed documents"])
def test_multi_device_matches_single_device(tmp_path, mesh, extra):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices; tests/conftest.py sets them")
    extra = [_short_documents(tmp_path / "docs.txt") if a == "SHORT_DOCUMENTS" else a for a in extra]
    common = ["--steps", "3", "--sample-len", "0", "--no-plot", "--no-ckpt", "--seq-len", "32"] + extra
    single = _run(tmp_path / "single", *common)
    multi = _run(tmp_path / "multi", "--mesh", mesh, *common)
    steps = range(1, 4)
    np.testing.assert_allclose([multi["losses"][s] for s in steps], [single["losses"][s] for s in steps],
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(multi["eval_loss"], single["eval_loss"], rtol=2e-5)
    if "tp=2" in mesh:  # parameters are sharded through the logical axis names
        spec = multi["params"]["layer_0"]["mlp"]["wi_kernel"].sharding.spec
        assert "tensor" in tuple(spec), spec


def _short_documents(path, n=400, seed=0):
    """A --data file of n short documents (paragraphs of 3-40 bytes, one with an indented second paragraph that
    stays in its document), so that every 32-byte window packs several."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        words = " ".join("".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(1, 6)))
                         for _ in range(rng.integers(1, 8)))
        docs.append(words + ("\n\n    indented" if i % 50 == 7 else ""))
    path.write_bytes("\n\n".join(docs).encode())
    return str(path)


def test_packed_batches_mark_documents():
    """sample_batch(docs=document_ids(...)): segment ids number each window's documents from 1, positions count
    from each document's first byte in the window, and the loss weight is 0 exactly where the target is the next
    document's first byte; against a loop over the bytes. document_ids starts a document at every non-indented
    line after a blank line (an indented one stays in its document)."""
    data = np.frombuffer(b"ab c\n\nde\n\n  f g\nh\n\nijk\n\n\nlm", np.uint8)
    np.testing.assert_array_equal(train_lm.document_ids(data)[[0, 6, 9, 12, 16, 19, 23, 25]], [0, 1, 1, 1, 1, 2, 2, 3])
    docs = train_lm.document_ids(data)
    x, y, pos, seg, w = train_lm.sample_batch(data, 3, 12, 0, 5, 0, docs=docs)
    x0, y0 = train_lm.sample_batch(data, 3, 12, 0, 5, 0)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)
    for b in range(3):
        # find this row's window in the data: the first offset whose bytes match
        start = next(i for i in range(len(data) - 12) if (data[i:i + 12] == x[b]).all()
                     and data[i + 12] == y[b, -1])
        d = docs[start:start + 13]
        want_seg, want_pos, n, p = [], [], 1, 0
        for t in range(12):
            if t and d[t] != d[t - 1]:
                n, p = n + 1, 0
            want_seg.append(n)
            want_pos.append(p)
            p += 1
        np.testing.assert_array_equal(seg[b], want_seg)
        np.testing.assert_array_equal(pos[b], want_pos)
        np.testing.assert_array_equal(w[b], [float(d[t + 1] == d[t]) for t in range(12)])
    assert seg.max() > 1 and (w == 0).any()  # the windows do cross documents


@pytest.mark.parametrize("layers", [[], ["--scan-layers"], ["--jit-layers"]], ids=["loop", "scan", "jit"])
def test_packed_model_equals_each_document_alone(layers):
    """--pack: a row packing two documents (segment ids, positions restarting) gives each document the logits of
    a forward over that document alone (fp32), through the plain layer loop, nn.scan (segment ids broadcast
    to every layer) and nn.jit; without segment ids a packed model refuses to run."""
    args = train_lm.parse_args(TINY + ["--layers", "2", "--pack"] + layers)
    model = train_lm.make_model(args)
    plain = train_lm.make_model(train_lm.parse_args(TINY + ["--layers", "2"] + layers))
    tokens = jax.random.randint(jax.random.key(0), (1, 32), 0, 256)
    cut = 13
    seg = jnp.where(jnp.arange(32) < cut, 1, 2)[None]
    pos = jnp.where(jnp.arange(32) < cut, jnp.arange(32), jnp.arange(32) - cut)[None]
    params = jax.jit(model.init)(jax.random.key(1), tokens, pos, segment_ids=seg)["params"]
    packed = jax.jit(lambda p: model.apply({"params": p}, tokens, pos, segment_ids=seg))(params)
    first = jax.jit(lambda p: plain.apply({"params": p}, tokens[:, :cut], jnp.arange(cut)[None]))(params)
    second = jax.jit(lambda p: plain.apply({"params": p}, tokens[:, cut:], jnp.arange(32 - cut)[None]))(params)
    np.testing.assert_allclose(packed[:, :cut], first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, cut:], second, rtol=1e-5, atol=1e-5)
    whole = jax.jit(lambda p: plain.apply({"params": p}, tokens, pos))(params)  # attention across the cut
    assert not np.allclose(packed[:, cut:], whole[:, cut:], atol=1e-3)
    with pytest.raises(ValueError, match="segment_ids"):
        model.apply({"params": params}, tokens, pos)


@pytest.mark.slow  # a fresh process on 8 fake devices; test_multi_device_matches_single_device runs the same mesh
def test_cli_on_fake_devices_prints_summary(tmp_path):
    """The documented command line: --cpu-devices 8 --mesh dp=2,cp=4 in a fresh process."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, SCRIPT, "--cpu-devices", "8", "--mesh", "dp=2,cp=4", "--steps", "2", "--sample-len", "8",
           "--no-plot", "--no-ckpt"] + TINY + ["--out-dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: steps 2"), res.stdout[-2000:]
    assert "'context': 4" in last and "8xcpu" in last


def test_second_half_rate_skips_the_slow_first_steps():
    """The summary's steady rate: tokens over the second half of the timed steps / their time."""
    # 10 timed steps of 100 tokens; the first 5 took 4 s in all, the last 5 took 1 s.
    clock = [(1, 2.0), (5, 4.0), (8, 4.6), (10, 5.0)]
    assert math.isclose(train_lm._second_half_rate(clock, 10, 5.0, 100), 5 * 100 / 1.0)
    assert math.isnan(train_lm._second_half_rate([], 10, 5.0, 100))
    assert math.isnan(train_lm._second_half_rate([(10, 5.0)], 10, 5.0, 100))  # no point inside the run


def test_scan_layers_matches_the_unscanned_stack_and_decodes():
    """--scan-layers: the same per-layer parameters stacked on a leading axis give the same logits, and
    KV-cache decoding through nn.scan gives the greedy tokens of the unscanned model."""
    args = train_lm.parse_args(TINY + ["--layers", "2"])
    scanned_args = train_lm.parse_args(TINY + ["--layers", "2", "--scan-layers"])
    model, scanned = train_lm.make_model(args), train_lm.make_model(scanned_args)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    pos = jnp.arange(16)[None]
    # jitted (eagerly every op compiles on its own); the scanned model's shapes from a trace
    params = flax.linen.unbox(jax.jit(model.init)(jax.random.key(1), tokens, pos)["params"])
    stacked = {k: v for k, v in params.items() if not k.startswith("layer_")}
    stacked["layers"] = {"layer": jax.tree.map(lambda a, b: jnp.stack([a, b]), params["layer_0"], params["layer_1"])}
    want_shapes = jax.tree.map(jnp.shape, flax.linen.unbox(
        jax.eval_shape(scanned.init, jax.random.key(1), tokens, pos)["params"]))
    assert jax.tree.map(jnp.shape, stacked) == want_shapes
    y_scanned, y = jax.jit(lambda stacked, params: (scanned.apply({"params": stacked}, tokens, pos),
                                                    model.apply({"params": params}, tokens, pos)))(stacked, params)
    np.testing.assert_allclose(y_scanned, y, rtol=1e-5, atol=1e-5)
    greedy = train_lm.generate(args, params, "def ", 3, seed=0, temperature=0.0)
    assert train_lm.generate(scanned_args, stacked, "def ", 3, seed=0, temperature=0.0) == greedy


def test_compile_cache_dir_follows_the_flags():
    assert train_lm.compile_cache_dir(train_lm.parse_args([])) == os.path.abspath(os.path.join("runs", "compile_cache"))
    assert train_lm.compile_cache_dir(train_lm.parse_args(["--compile-cache-dir", "/tmp/c"])) == "/tmp/c"
    assert train_lm.compile_cache_dir(train_lm.parse_args(["--no-compile-cache"])) is None
