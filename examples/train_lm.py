"""Train a small byte-level decoder-only language model built from te_jax.flax.TransformerLayer.

    python examples/train_lm.py                      # CPU-sized default: a few minutes, loss falls
    python examples/train_lm.py --preset gpu         # ~12 layers, hidden 768, seq 1024, batch 16, bf16
    python examples/train_lm.py --resume             # continue from the latest checkpoint in --ckpt-dir
    python examples/train_lm.py --pack               # packed documents: segment ids, per-document positions
    python examples/train_lm.py --preset gpu --scan-layers   # nn.scan over the layers: one layer compiled
    python examples/train_lm.py --preset gpu --jit-layers    # nn.jit on each layer: one layer traced
    python examples/train_lm.py --cpu-devices 8 --mesh dp=2,cp=4      # 8 fake CPU devices
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_lm.py --mesh dp=2,cp=4

Model: byte embedding (256) + learned positions → N × TransformerLayer (pre-LN, causal, GeLU MLP,
no dropout) → final LayerNorm → tied (or separate, --untied) output head. fp32 parameters, bf16
(or fp32) compute. Optimiser: AdamW, linear warm-up + cosine decay, global-norm clipping.

Data: by default the source text of a fixed list of Python standard-library modules (present on
every machine, no download), or any text/binary file with --data PATH. The last 10% of the bytes
are held out for the evaluation loss. The batch of step i depends only on (seed, i), so a resumed
run sees exactly the batches an uninterrupted run would.

Packed documents (--pack): the text is cut into documents (a new one at every non-indented line after a
blank line: the modules' top-level blocks, a text's paragraphs), and each training window packs the
documents it covers as a pretraining pipeline packs its rows. The window's segment ids (1, 2, ... per
document) go to every TransformerLayer (q_segment_ids / kv_segment_ids: attention never crosses a
document), the learned positions restart at each document's first byte, and the loss skips the targets
that belong to the next document. On an H100/H200 at head dim 128 (e.g. --preset gpu --heads 6) the attention
then runs the Hopper kernel on tiles that start at every document; the GPU preset's head dim 64 keeps the
global grid unless TE_JAX_HOPPER_ALIGNED_TILES=1.

Multi-device (--mesh dp=D,cp=C,tp=T over the visible devices, a size of -1 takes the remaining
devices): parameters are sharded through the modules' logical axis names (nn.logical_axis_rules:
heads / kv_heads / mlp → "tensor"), the batch over "data", the sequence over "context" with
context-parallel attention (ring by default, --cp-strategy all_gather) and zig-zag load balancing:
the tokens, targets and positions are reordered once with te_jax.context_parallel.
reorder_causal_load_balancing (the loss is a mean over tokens, so the order does not matter).
Multi-host: pass --coordinator-address HOST:PORT --num-processes N --process-id I on every host
(jax.distributed.initialize); every process builds the same global batch and feeds its own shards.

Compilation: jax's persistent compilation cache is on (--compile-cache-dir, default runs/compile_cache;
--no-compile-cache turns it off), so a second run with the same shapes loads its compiled steps instead of
compiling them again. --scan-layers traces and compiles one layer for the whole stack (nn.scan); --jit-layers
traces and lowers one layer and calls it per layer (nn.jit; XLA inlines the calls, so the step runs as fast as
the plain loop, and compile time grows less with depth).

Last line printed: `summary: ...` with steps, the final train / eval loss and tokens/s.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time


def _apply_cpu_devices_flag(argv):
    """--cpu-devices N must act before jax is imported: it sets XLA_FLAGS for N fake CPU devices."""
    for i, a in enumerate(argv):
        n = None
        if a == "--cpu-devices" and i + 1 < len(argv):
            n = argv[i + 1]
        elif a.startswith("--cpu-devices="):
            n = a.split("=", 1)[1]
        if n is not None and "jax" not in sys.modules:
            flag = f"--xla_force_host_platform_device_count={int(n)}"
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
            os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    _apply_cpu_devices_flag(sys.argv[1:])

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import te_jax  # noqa: E402,F401
from te_jax.flax import DenseGeneral, LayerNorm, TransformerLayer  # noqa: E402
from te_jax.fp8 import FP8_COLLECTION  # noqa: E402
from te_jax.masks import segment_positions  # noqa: E402

try:
    from tqdm.auto import tqdm
except ImportError:  # the GPU machine may not have it: plain prints instead
    tqdm = None

# --------------------------------------------------------------------------------------------- config

PRESETS = {
    # a CPU run of a few minutes; fp32 compute because CPUs have no fast bf16 matmul (--dtype bf16 works)
    "cpu": dict(layers=2, hidden=128, heads=4, gqa_groups=None, ffn=512, seq_len=128, batch=16, steps=300,
                lr=3e-3, warmup=20, dtype="fp32", eval_every=100, eval_batches=8, log_every=10),
    # sized for one H100 (~85M parameters)
    "gpu": dict(layers=12, hidden=768, heads=12, gqa_groups=None, ffn=3072, seq_len=1024, batch=16, steps=300,
                lr=1e-3, warmup=50, dtype="bf16", eval_every=100, eval_batches=16, log_every=10),
}

STDLIB_FILES = (
    "argparse", "ast", "calendar", "collections/__init__", "configparser", "dataclasses", "difflib", "enum",
    "fractions", "functools", "inspect", "json/decoder", "json/encoder", "logging/__init__", "pathlib",
    "pprint", "random", "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "zipfile",
)

MESH_AXES = {"dp": "data", "cp": "context", "tp": "tensor"}


def _fp8_recipes():
    from te_jax import fp8

    return {"delayed": fp8.DelayedScaling(), "current": fp8.Float8CurrentScaling(), "block": fp8.Float8BlockScaling()}


FP8_RECIPES = ("block", "current", "delayed")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="defaults for every model/training flag left unset")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--gqa-groups", type=int, help="key/value heads (default: = heads)")
    g.add_argument("--ffn", type=int, help="MLP hidden size")
    g.add_argument("--untied", action="store_true", help="separate output head instead of the tied embedding")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "cudnn", "xla"])
    g.add_argument("--attn-input-format", default="bshd", choices=["bshd", "sbhd"])
    g.add_argument("--scan-layers", action="store_true",
                   help="nn.scan over the layers: one layer is traced and compiled, parameters stacked on a "
                        "leading 'layers' axis (checkpoints of scanned and unscanned models differ)")
    g.add_argument("--jit-layers", action="store_true",
                   help="nn.jit on each layer: jax traces and lowers one layer and calls it per layer (XLA inlines "
                        "the calls; the same step, compiled faster at depth). Parameters nest one level deeper "
                        "(layer_i/layer/...): checkpoints of jitted and plain models differ")
    g.add_argument("--dtype", choices=["bf16", "fp32"], help="compute dtype (parameters are always fp32)")
    g.add_argument("--fp8", choices=sorted(FP8_RECIPES),
                   help="train with FP8 GEMMs under te_jax.fp8.autocast: delayed = DelayedScaling() (its state "
                        "is trained through the gradient and checkpointed as state['fp8']), current = "
                        "Float8CurrentScaling(), block = Float8BlockScaling() (reference numerics, not an FP8 "
                        "GEMM); sampling at the end runs without FP8")
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int)
    g.add_argument("--batch", type=int, help="global batch size")
    g.add_argument("--steps", type=int, help="total optimiser steps, which also set the schedule (a resumed run "
                   "continues up to it)")
    g.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this step, as a preempted job "
                   "would; --resume continues with the same schedule")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup", type=int)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--data", help="train on this file's bytes instead of the Python stdlib sources")
    g.add_argument("--pack", action="store_true", help="packed documents: segment ids per document in each window, "
                   "positions restarting at each document, no loss across a document's end (see the docstring)")
    g.add_argument("--eval-every", type=int)
    g.add_argument("--eval-batches", type=int)
    g.add_argument("--log-every", type=int)
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default="runs/train_lm", help="loss curve and default checkpoint directory")
    g.add_argument("--ckpt-dir", help="orbax checkpoints (default: OUT_DIR/ckpt)")
    g.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument("--no-ckpt", action="store_true", help="save no checkpoint")
    g.add_argument("--resume", action="store_true", help="restore the latest checkpoint of --ckpt-dir")
    g.add_argument("--sample-len", type=int, default=200, help="bytes to generate at the end (0: none)")
    g.add_argument("--prompt", default="def ")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of a tqdm bar")
    g.add_argument("--compile-cache-dir", default=os.path.join("runs", "compile_cache"),
                   help="jax's persistent compilation cache: a later run with the same shapes loads the compiled "
                        "step from here instead of compiling it")
    g.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compilation cache")
    g = p.add_argument_group("devices")
    g.add_argument("--mesh", default="dp=1,cp=1,tp=1",
                   help="mesh sizes over the visible devices, e.g. dp=2,cp=4 or dp=-1,cp=2 (-1: the rest)")
    g.add_argument("--cp-strategy", default="ring", choices=["ring", "all_gather"])
    g.add_argument("--no-load-balance", action="store_true", help="context parallelism without the zig-zag reorder")
    g.add_argument("--cpu-devices", type=int, help="N fake CPU devices (sets XLA_FLAGS; only before jax starts)")
    g.add_argument("--coordinator-address", help="multi-host: HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.ckpt_dir is None:
        args.ckpt_dir = os.path.join(args.out_dir, "ckpt")
    return args


# --------------------------------------------------------------------------------------------- data


def stdlib_text() -> bytes:
    """The source of a fixed list of standard-library modules (whichever exist in this Python)."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in STDLIB_FILES:
        for cand in (name + ".py", name + "/__init__.py"):
            path = os.path.join(root, cand)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    parts.append(f.read())
                break
    if not parts:
        raise FileNotFoundError(f"no standard-library sources found under {root}; pass --data PATH")
    return b"\n".join(parts)


def load_data(path=None):
    """(train bytes, eval bytes) as uint8 arrays; the last 10% is held out."""
    if path:
        with open(path, "rb") as f:
            raw = f.read()
    else:
        raw = stdlib_text()
    data = np.frombuffer(raw, dtype=np.uint8)
    n_eval = max(len(data) // 10, 1)
    return data[:-n_eval], data[-n_eval:]


def document_ids(data):
    """[n] int32: each byte's document number (0, 1, ...), a new document at every non-indented line after a
    blank line (the modules' top-level blocks; a text's paragraphs)."""
    data = np.asarray(data, np.uint8)
    start = np.zeros(len(data), bool)
    if len(data) > 2:
        blank_line_before = (data[:-2] == ord("\n")) & (data[1:-1] == ord("\n"))
        start[2:] = blank_line_before & ~np.isin(data[2:], np.frombuffer(b" \t\n\r", np.uint8))
    return np.cumsum(start, dtype=np.int32)


def sample_batch(data, batch, seq_len, seed, index, stream, docs=None):
    """Batch `index` of a stream: random windows drawn from (seed, stream, index) alone: (tokens [b, s], targets
    [b, s]).  docs (document_ids of data): also (positions [b, s] counted from each document's first byte in the
    window, segment ids [b, s] numbered 1, 2, ... per document in each window, loss weights [b, s]: 0 where the
    target is the next document's first byte), the order a packed train step takes them in."""
    if len(data) < seq_len + 2:
        raise ValueError(f"the data has {len(data)} bytes; --seq-len {seq_len} needs at least {seq_len + 2}")
    rng = np.random.default_rng([seed, stream, index])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    win = data[idx].astype(np.int32)
    if docs is None:
        return win[:, :-1], win[:, 1:]
    d = docs[idx]
    seg = (d[:, :-1] - d[:, :1] + 1).astype(np.int32)
    pos = np.asarray(segment_positions(seg))  # 0, 1, ... from each document's first byte in the window
    weights = (d[:, 1:] == d[:, :-1]).astype(np.float32)
    return win[:, :-1], win[:, 1:], pos, seg, weights


# --------------------------------------------------------------------------------------------- model


class ScannedLayer(nn.Module):
    """nn.scan's (and nn.jit's) body: one TransformerLayer, (x, segment ids or None) -> (x, None). layer:
    TransformerLayer's fields as items (hashable, as nn.jit needs)."""

    layer: tuple
    decode: bool = False

    @nn.compact
    def __call__(self, x, seg):
        return TransformerLayer(**dict(self.layer), name="layer")(
            x, deterministic=True, decode=self.decode, q_segment_ids=seg, kv_segment_ids=seg), None


class ByteLM(nn.Module):
    """Decoder-only LM: tokens [b, s] int, positions [b|1, s] int (, segment_ids [b, s] int with packed: each
    document's tokens attend within it) → logits [b, s, vocab] fp32."""

    vocab_size: int = 256
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_gqa_groups: int | None = None
    mlp_hidden_size: int = 512
    max_seq_len: int = 128
    dtype: object = jnp.bfloat16
    attn_input_format: str = "bshd"
    attention_backend: str = "auto"
    tie_embeddings: bool = True
    context_parallel_axis: str | None = None
    context_parallel_strategy: str = "ring"
    context_parallel_load_balanced: bool = False
    scan_layers: bool = False
    jit_layers: bool = False
    packed: bool = False

    @nn.compact
    def __call__(self, tokens, positions, decode: bool = False, segment_ids=None):
        if self.packed and not decode and segment_ids is None:
            raise ValueError("ByteLM(packed=True): pass segment_ids [batch, seq] (1, 2, ... per document).")
        seg = segment_ids if self.packed and not decode else None  # decoding: one document
        init = nn.initializers.normal(0.02)
        emb = self.param("embedding", nn.with_logical_partitioning(init, ("vocab", "embed")),
                         (self.vocab_size, self.hidden_size), jnp.float32)
        pos = self.param("pos_embedding", nn.with_logical_partitioning(init, ("positions", "embed")),
                         (self.max_seq_len, self.hidden_size), jnp.float32)
        x = (jnp.take(emb, tokens, axis=0) + jnp.take(pos, positions, axis=0)).astype(self.dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        sbhd = self.attn_input_format == "sbhd"
        if sbhd:
            x = jnp.swapaxes(x, 0, 1)
        layer = dict(
            hidden_size=self.hidden_size, mlp_hidden_size=self.mlp_hidden_size,
            num_attention_heads=self.num_heads, num_gqa_groups=self.num_gqa_groups,
            hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
            mlp_activations=("gelu",), layer_type="encoder", self_attn_mask_type="causal",
            enable_relative_embedding=False, dtype=self.dtype, param_dtype=jnp.float32,
            # the example's own choice (TE's MultiHeadAttention default); TransformerLayer's is "normal"
            mha_kernel_init=nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
            attn_input_format=self.attn_input_format, attention_backend=self.attention_backend,
            context_parallel_axis=self.context_parallel_axis,
            context_parallel_strategy=self.context_parallel_strategy,
            context_parallel_load_balanced=self.context_parallel_load_balanced)
        if self.scan_layers:  # one layer traced and compiled; params and cache stacked on a leading axis
            layers = nn.scan(ScannedLayer, variable_axes={"params": 0, "cache": 0, FP8_COLLECTION: 0},
                             split_rngs={"params": True}, in_axes=nn.broadcast,
                             length=self.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = layers(layer=tuple(layer.items()), decode=decode, name="layers")(x, seg)
        elif self.jit_layers:  # one wrapper for every layer: identical layers share its trace and lowering
            jitted = nn.jit(ScannedLayer)
            for i in range(self.num_layers):
                x, _ = jitted(layer=tuple(layer.items()), decode=decode, name=f"layer_{i}")(x, seg)
        else:
            for i in range(self.num_layers):
                x = TransformerLayer(**layer, name=f"layer_{i}")(x, deterministic=True, decode=decode,
                                                                 q_segment_ids=seg, kv_segment_ids=seg)
        x = LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="final_norm",  # per shard under a mesh
                      layernorm_input_axes=("length", "batch", "embed") if sbhd else ("batch", "length", "embed"))(x)
        if sbhd:
            x = jnp.swapaxes(x, 0, 1)
        if self.tie_embeddings:
            logits = jnp.einsum("bsh,vh->bsv", x, emb.astype(self.dtype), preferred_element_type=jnp.float32)
        else:
            logits = DenseGeneral(features=self.vocab_size, kernel_axes=("embed", "vocab"), dtype=self.dtype,
                                  param_dtype=jnp.float32, name="lm_head")(x)
        return logits.astype(jnp.float32)


def make_model(args, context_parallel=None):
    cp_axis, strategy, balanced = context_parallel or (None, "ring", False)
    return ByteLM(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                  num_gqa_groups=args.gqa_groups, mlp_hidden_size=args.ffn, max_seq_len=args.seq_len,
                  dtype=jnp.bfloat16 if args.dtype == "bf16" else jnp.float32,
                  attn_input_format=args.attn_input_format, attention_backend=args.attention_backend,
                  tie_embeddings=not args.untied, context_parallel_axis=cp_axis,
                  context_parallel_strategy=strategy, context_parallel_load_balanced=balanced,
                  scan_layers=args.scan_layers, jit_layers=args.jit_layers, packed=args.pack)


def _global_norm(tree):
    tree_mod = getattr(optax, "tree", None)
    return tree_mod.norm(tree) if hasattr(tree_mod, "norm") else optax.global_norm(tree)


def cross_entropy(logits, targets, weights=None):
    """Mean negative log-likelihood of targets [b, s]; weights [b, s] (0 / 1): a mean over the weighted ones."""
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), targets[..., None], -1)[..., 0]
    if weights is None:
        return -jnp.mean(logp)
    return -jnp.sum(logp * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_optimizer(args):
    """(learning-rate schedule, optax transformation): AdamW, warm-up + cosine decay, norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(args.warmup, 1), max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.1)
    tx = optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    return schedule, tx


def build_train_step(model, tx, mesh, rules, batch, seq_len):
    """The jitted pieces of training `model` with `tx` on `mesh` (global batch [batch, seq_len]).

    Returns a dict: init (key -> state {params, opt_state} on its shardings), abstract_state
    (ShapeDtypeStructs with those shardings), train_step ((state, x, y, pos) -> (state, loss,
    grad norm), state donated), eval_loss ((params, x, y, pos) -> loss), data_sharding (the
    batch's: "data" × "context"). A packed model (ByteLM.packed) takes (x, y, pos, seg, weights) in
    place of (x, y, pos): segment ids and loss weights (sample_batch). Parameters and optimiser state
    are sharded through the logical axis names. Trace and call them under `jax.set_mesh(mesh)` and
    `nn.logical_axis_rules(rules)`.
    """
    n_batch = 5 if model.packed else 3
    data_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def init_state(key):
        dummy = jnp.zeros((batch, seq_len), jnp.int32)
        variables = model.init(key, dummy, jnp.zeros((batch, seq_len), jnp.int32),
                               segment_ids=jnp.ones((batch, seq_len), jnp.int32) if model.packed else None)
        params = variables["params"]
        state = {"params": params, "opt_state": tx.init(params)}  # boxed: the optimiser state inherits the axes
        if FP8_COLLECTION in variables:  # --fp8 delayed: scales and amax histories (te_jax/fp8/state.py)
            state["fp8"] = variables[FP8_COLLECTION]
        return state

    def loss_fn(params, data, fp8_state=None):
        variables = {"params": params} if fp8_state is None else {"params": params, FP8_COLLECTION: fp8_state}
        x, y, pos, seg, weights = data if model.packed else (*data, None, None)
        return cross_entropy(model.apply(variables, x, pos, segment_ids=seg), y, weights)

    def train_step(state, *data):
        # under DelayedScaling the gradient with respect to the FP8 state is the next state
        loss, (grads, fp8_state) = jax.value_and_grad(loss_fn, argnums=(0, 2))(state["params"], data,
                                                                                state.get("fp8"))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state}
        if "fp8" in state:
            new["fp8"] = fp8_state
        return new, loss, _global_norm(grads)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(init_state, jax.random.key(0))
        logical = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(logical, mesh, rules)
        shardings = nn.unbox(jax.tree.map(lambda s: replicated if s is None else s, shardings,
                                          is_leaf=lambda s: s is None))
        shapes = jax.eval_shape(lambda k: nn.unbox(init_state(k)), jax.random.key(0))
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    return {
        "init": jax.jit(lambda k: nn.unbox(init_state(k)), out_shardings=shardings),
        "abstract_state": abstract_state,
        "train_step": jax.jit(train_step, in_shardings=(shardings,) + (data_sharding,) * n_batch,
                              out_shardings=(shardings, replicated, replicated), donate_argnums=0),
        "eval_loss": jax.jit(lambda params, *data_and_fp8: loss_fn(params, data_and_fp8[:n_batch],
                                                                   *data_and_fp8[n_batch:]),
                             out_shardings=replicated),
        "data_sharding": data_sharding,
    }


# --------------------------------------------------------------------------------------------- mesh


def parse_mesh(spec: str, n_devices: int):
    sizes = {"dp": 1, "cp": 1, "tp": 1}
    for part in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = part.partition("=")
        if key not in sizes or not val:
            raise ValueError(f"--mesh {spec!r}: expected entries like dp=2,cp=4,tp=1 (axes dp, cp, tp)")
        sizes[key] = int(val)
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"--mesh {spec!r}: at most one axis may be -1")
    if free:
        rest = math.prod(v for k, v in sizes.items() if v != -1)
        sizes[free[0]] = n_devices // rest
    total = math.prod(sizes.values())
    if total < 1 or total > n_devices:
        raise ValueError(f"--mesh {spec!r} needs {total} devices but {n_devices} are visible "
                         "(fake CPU devices: --cpu-devices N or XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return sizes


def make_mesh(sizes):
    n = math.prod(sizes.values())
    devices = np.array(jax.devices()[:n]).reshape(sizes["dp"], sizes["cp"], sizes["tp"])
    names = tuple(MESH_AXES[k] for k in ("dp", "cp", "tp"))
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def logical_rules(args, sizes):
    tp = sizes["tp"]
    groups = args.gqa_groups or args.heads
    for name, n in (("heads", args.heads), ("ffn", args.ffn)):
        if n % tp:
            raise ValueError(f"--{name} {n} is not divisible by tp={tp}")
    return (
        ("batch", "data"),
        ("length", "context"),
        ("heads", "tensor"),
        ("kv_heads", "tensor" if groups % tp == 0 else None),
        ("mlp", "tensor"),
        ("act", None), ("qkv", None), ("kv", None), ("embed", None), ("vocab", None), ("positions", None),
        ("layers", None),
    )


# --------------------------------------------------------------------------------------------- checkpoints


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return None
    return ocp


class Checkpointer:
    """Orbax CheckpointManager of {params, opt_state} plus a JSON of the config and the loss history."""

    def __init__(self, directory):
        self.ocp = _ocp()
        if self.ocp is None:
            raise ImportError("checkpoints need orbax-checkpoint (pip install orbax-checkpoint), or pass --no-ckpt")
        self.mngr = self.ocp.CheckpointManager(
            os.path.abspath(directory), options=self.ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def latest_step(self):
        return self.mngr.latest_step()

    def save(self, step, state, meta):
        a = self.ocp.args
        self.mngr.save(step, args=a.Composite(state=a.StandardSave(state), meta=a.JsonSave(meta)), force=True)

    def restore_meta(self, step):
        a = self.ocp.args
        return self.mngr.restore(step, args=a.Composite(meta=a.JsonRestore()))["meta"]

    def restore(self, step, abstract_state):
        a = self.ocp.args
        return self.mngr.restore(step, args=a.Composite(state=a.StandardRestore(abstract_state)))["state"]

    def close(self):
        self.mngr.wait_until_finished()
        self.mngr.close()


MODEL_KEYS = ("layers", "hidden", "heads", "gqa_groups", "ffn", "seq_len", "untied", "scan_layers", "jit_layers")


# --------------------------------------------------------------------------------------------- training


def _log(msg):
    if jax.process_index() == 0:
        print(msg, flush=True)


def compile_cache_dir(args):
    """The persistent compilation cache's directory (absolute), or None with --no-compile-cache."""
    return None if args.no_compile_cache else os.path.abspath(args.compile_cache_dir)


def enable_compile_cache(path):
    """Turn on jax's persistent compilation cache in `path` (before the first compile of this process)."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def train(args):
    """Train (or resume) as the flags say. Returns a dict: losses {step: loss}, eval_loss, tokens_per_s, sample."""
    cache_dir = compile_cache_dir(args)
    if cache_dir is not None:
        enable_compile_cache(cache_dir)
    if args.coordinator_address:
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=args.num_processes, process_id=args.process_id)
    sizes = parse_mesh(args.mesh, jax.device_count())
    mesh = make_mesh(sizes)
    rules = logical_rules(args, sizes)
    cp = sizes["cp"]
    balanced = cp > 1 and not args.no_load_balance
    cp_cfg = ("context", args.cp_strategy, balanced) if cp > 1 else None
    model = make_model(args, cp_cfg)
    if args.batch % sizes["dp"]:
        raise ValueError(f"--batch {args.batch} is not divisible by dp={sizes['dp']}")
    div = 2 * cp if balanced else cp
    if args.seq_len % div:
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by {div} (cp={cp}"
                         f"{', zig-zag load balancing' if balanced else ''})")

    train_data, eval_data = load_data(args.data)
    train_docs, eval_docs = (document_ids(train_data), document_ids(eval_data)) if args.pack else (None, None)
    B, S = args.batch, args.seq_len
    _log(f"data: {len(train_data):,} train bytes, {len(eval_data):,} eval bytes "
         f"({args.data or 'Python stdlib sources'})")
    _log(f"devices: {jax.device_count()} x {jax.devices()[0].platform} ({jax.process_count()} process(es)); "
         f"mesh {dict(mesh.shape)}" + (f"; context parallel {args.cp_strategy}"
                                       f"{' load-balanced' if balanced else ''}" if cp > 1 else ""))

    schedule, tx = make_optimizer(args)
    built = build_train_step(model, tx, mesh, rules, B, S)
    data_sharding = built["data_sharding"]

    def to_global(x_np, sharding):
        """Every process holds the same global numpy batch; each feeds its addressable shards."""
        return jax.make_array_from_callback(x_np.shape, sharding, lambda idx: x_np[idx])

    positions_np = np.broadcast_to(np.arange(S, dtype=np.int32)[None], (B, S))

    def make_batch(x, y, *packed):
        """(x, y, pos) on the mesh; packed: sample_batch's (pos, seg, weights) -> (x, y, pos, seg, weights)."""
        arrays = (x, y, *packed) if packed else (x, y, positions_np)
        if balanced:  # zig-zag order once, for tokens, targets, positions (and segment ids, weights) alike
            from te_jax.context_parallel import reorder_causal_load_balancing
            arrays = [np.asarray(reorder_causal_load_balancing(a, cp, seq_axis=1)) for a in arrays]
        return tuple(to_global(np.ascontiguousarray(a), data_sharding) for a in arrays)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        state = built["init"](jax.random.key(args.seed))
    train_step, eval_loss_fn = built["train_step"], built["eval_loss"]

    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state["params"]))
    _log(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
         f"({args.gqa_groups or args.heads} kv), ffn {args.ffn}, seq {S}, batch {B}, {args.dtype}, "
         f"{args.attn_input_format}, attention backend {args.attention_backend}; {n_params:,} parameters")
    if args.pack:
        _, _, _, seg, w = sample_batch(train_data, B, S, args.seed, 1, stream=0, docs=train_docs)
        _log(f"packed documents: {int(train_docs[-1]) + 1:,} in the train bytes; the first batch's rows hold "
             f"{seg.max(axis=1).mean():.1f} documents on average, {int((w == 0).sum())} targets across a document's "
             f"end left out of the loss")

    eval_batches = [make_batch(*sample_batch(eval_data, B, S, args.seed, i, stream=1, docs=eval_docs))
                    for i in range(args.eval_batches)]

    def evaluate(params, fp8_state=None):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return float(np.mean([float(eval_loss_fn(params, *b, fp8_state)) for b in eval_batches]))

    # ---- checkpoint / resume
    ckpt = None
    if not args.no_ckpt:
        if _ocp() is None and not args.resume:
            _log("(orbax-checkpoint is not installed: no checkpoints; pip install orbax-checkpoint)")
        else:
            ckpt = Checkpointer(args.ckpt_dir)
            if not args.resume and ckpt.latest_step() is not None:  # refused before training, not at its end
                step = ckpt.latest_step()
                ckpt.close()
                raise FileExistsError(
                    f"{os.path.abspath(args.ckpt_dir)} already holds a run's checkpoints (latest step "
                    f"{step}). Fix: --resume continues that run; another --out-dir (or --ckpt-dir) "
                    f"starts a new one beside it; --no-ckpt trains without checkpoints.")
    config = {k: getattr(args, k) for k in MODEL_KEYS}
    history = {"train": [], "eval": []}
    start = 0
    if args.resume:
        if ckpt is None or ckpt.latest_step() is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.abspath(args.ckpt_dir)}")
        start = ckpt.latest_step()
        abstract_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        meta = ckpt.restore_meta(start)
        saved = {"jit_layers": False, **meta["config"]}  # checkpoints from before --jit-layers existed
        if saved != config:
            raise ValueError(f"--resume: the checkpoint's model {saved} differs from the flags' {config}")
        state = ckpt.restore(start, abstract_state)
        history = meta["history"]
        history["train"] = [h for h in history["train"] if h[0] <= start]
        history["eval"] = [h for h in history["eval"] if h[0] <= start]
        _log(f"resumed from {os.path.abspath(args.ckpt_dir)} at step {start}")

    def save(step):
        if ckpt is not None:
            ckpt.save(step, state, {"config": config, "history": history})

    # ---- loop
    losses = {}
    tokens_per_step = B * S
    bar = None
    end = args.steps if args.stop_after is None else max(start, min(args.steps, args.stop_after))
    if tqdm is not None and not args.no_progress and jax.process_index() == 0 and start < end:
        bar = tqdm(total=end, initial=start, desc="train", dynamic_ncols=True)
    t_first = None  # timing starts after the first (compiling) step; evaluations and saves are not counted
    paused = 0.0
    steps_timed = 0
    clock = []  # (steps timed, seconds) at each log point: the steady rate is read off the second half
    pending = []
    float(schedule(start + 1))  # the log line's eager schedule ops compile here, not inside the timed steps
    t0 = time.perf_counter()
    for step in range(start + 1, end + 1):
        batch = make_batch(*sample_batch(train_data, B, S, args.seed, step, stream=0, docs=train_docs))
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            state, loss, gnorm = train_step(state, *batch)
        pending.append((step, loss, gnorm))
        if step == start + 1:
            jax.block_until_ready(loss)
            t_first = time.perf_counter()
            say = bar.write if bar is not None else _log
            say(f"step {step}: compiled and ran the first step in {t_first - t0:.1f}s")
        else:
            steps_timed += 1
        last = step == end
        if step % args.log_every == 0 or last or step == start + 1:
            for s, l_, g in pending:
                losses[s] = float(l_)
                history["train"].append([s, losses[s]])
            pending = []
            elapsed = time.perf_counter() - t_first - paused if t_first else 0.0
            tps = f"{steps_timed * tokens_per_step / elapsed:,.0f}" if steps_timed and elapsed > 0 else "-"
            if steps_timed:
                clock.append((steps_timed, elapsed))
            msg = dict(loss=f"{losses[step]:.4f}", gnorm=f"{float(g):.2f}", lr=f"{float(schedule(step)):.2e}",
                       tok_s=tps)
            if bar is not None:
                bar.set_postfix(msg, refresh=False)
            else:
                _log(f"step {step}/{args.steps}  " + "  ".join(f"{k} {v}" for k, v in msg.items()))
        if bar is not None:
            bar.update(1)
        if args.eval_every and (step % args.eval_every == 0) and not last:
            t_pause = time.perf_counter()
            ev = evaluate(state["params"], state.get("fp8"))
            history["eval"].append([step, ev])
            (bar.write if bar is not None else _log)(f"step {step}: eval loss {ev:.4f}")
            paused += time.perf_counter() - t_pause
        if args.ckpt_every and step % args.ckpt_every == 0 and not last:
            t_pause = time.perf_counter()
            jax.block_until_ready(state)
            save(step)
            paused += time.perf_counter() - t_pause
    if bar is not None:
        bar.close()
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - t_first - paused if t_first and steps_timed else float("nan")
    tokens_per_s = steps_timed * tokens_per_step / elapsed if steps_timed else float("nan")
    steady_tokens_per_s = _second_half_rate(clock, steps_timed, elapsed, tokens_per_step)

    final_step = max(start, end)
    eval_loss = evaluate(state["params"], state.get("fp8"))
    if not history["eval"] or history["eval"][-1][0] != final_step:
        history["eval"].append([final_step, eval_loss])
    _log(f"step {final_step}: eval loss {eval_loss:.4f} (held-out bytes; ln(256) = {math.log(256):.3f} is chance)")
    if ckpt is not None:
        if start < end:
            save(final_step)
        ckpt.close()
        _log(f"checkpoint: {os.path.abspath(args.ckpt_dir)} (step {final_step})")

    if not args.no_plot and jax.process_index() == 0:
        plot_losses(history, os.path.join(args.out_dir, "loss.png"))

    sample = None
    if args.sample_len > 0:
        if jax.process_count() > 1:  # a collective: every process gathers the full parameters
            from jax.experimental import multihost_utils
            host_params = multihost_utils.process_allgather(state["params"], tiled=True)
        else:
            host_params = jax.device_get(state["params"])
    if args.sample_len > 0 and jax.process_index() == 0:
        from te_jax import fp8

        with fp8.autocast(enabled=False):  # KV-cache decoding without FP8 (no FP8 state in the decode call)
            sample = generate(args, host_params, args.prompt, args.sample_len, args.seed, args.temperature)
        _log(f"sample (KV-cache decoding, temperature {args.temperature}):\n" + "-" * 60 + "\n" + sample + "\n" + "-" * 60)

    final_train = losses.get(final_step, history["train"][-1][1] if history["train"] else float("nan"))
    _log(f"summary: steps {final_step}  train_loss {final_train:.4f}  eval_loss {eval_loss:.4f}  "
         f"tokens/s {tokens_per_s:,.0f} (2nd half {steady_tokens_per_s:,.0f})  params {n_params:,}  mesh {dict(mesh.shape)}  "
         f"devices {jax.device_count()}x{jax.devices()[0].platform}  dtype {args.dtype}")
    return {"losses": losses, "eval_loss": eval_loss, "tokens_per_s": tokens_per_s,
            "steady_tokens_per_s": steady_tokens_per_s, "sample": sample,
            "step": final_step, "history": history, "params": state["params"]}


def _second_half_rate(clock, steps_timed, elapsed, tokens_per_step):
    """Tokens/s over the second half of the timed steps: the first steps after the compile run slow
    (the cumulative average still rises at the end of a short run). nan when too few steps were logged."""
    if not steps_timed or not clock:
        return float("nan")
    mid = next(((s, t) for s, t in clock if s >= steps_timed / 2 and s < steps_timed), None)
    if mid is None:
        return float("nan")
    return (steps_timed - mid[0]) * tokens_per_step / max(elapsed - mid[1], 1e-9)


def plot_losses(history, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("(matplotlib missing: no loss plot)")
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    if history["train"]:
        s, l_ = zip(*history["train"])
        ax.plot(s, l_, label="train")
    if history["eval"]:
        s, l_ = zip(*history["eval"])
        ax.plot(s, l_, "o-", label="eval (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title("te_jax byte-level LM")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    _log(f"loss curve: {os.path.abspath(path)}")


# --------------------------------------------------------------------------------------------- sampling


def generate(args, params, prompt: str, length: int, seed: int, temperature: float = 0.8):
    """Autoregressive sampling on one device with the KV cache (decode=True, "cache" collection)."""
    model = make_model(args)  # no context parallelism for decoding
    prompt_ids = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int32)[None]
    P = prompt_ids.shape[1]
    total = min(P + length, args.seq_len)  # learned positions: at most seq_len tokens
    if P >= total:
        return prompt
    # the cache is created by a call on an input of the maximum length (shapes only: eval_shape)
    cache_shapes = jax.eval_shape(
        lambda p: model.apply({"params": p}, jnp.zeros((1, total), jnp.int32),
                              jnp.arange(total, dtype=jnp.int32)[None], decode=True, mutable=["cache"])[1]["cache"],
        params)
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache_shapes)

    @jax.jit
    def step(params, cache, tokens, pos, key):  # params as an argument, not baked in as constants
        logits, new_vars = model.apply({"params": params, "cache": cache}, tokens, pos, decode=True,
                                       mutable=["cache"])
        if temperature > 0:
            nxt = jax.random.categorical(key, logits[:, -1] / temperature, axis=-1)
        else:  # greedy
            nxt = jnp.argmax(logits[:, -1], axis=-1)
        return new_vars["cache"], nxt.astype(jnp.int32)

    params = jax.device_put(params)
    key = jax.random.key(seed + 1)
    out = list(prompt_ids[0])
    cache, nxt = step(params, cache, jnp.asarray(prompt_ids), jnp.arange(P, dtype=jnp.int32)[None],
                      jax.random.fold_in(key, 0))  # prefill
    for t in range(P, total):
        out.append(int(nxt[0]))
        if t + 1 == total:
            break
        cache, nxt = step(params, cache, nxt[:, None], jnp.full((1, 1), t, jnp.int32), jax.random.fold_in(key, t))
    return bytes(out).decode("utf-8", errors="replace")


def main(argv=None):
    args = parse_args(argv)
    if args.fp8:
        from te_jax import fp8

        recipe = _fp8_recipes()[args.fp8]
        _log(f"fp8: {recipe!r} (te_jax.fp8.autocast around training; sampling runs without FP8)")
        with fp8.autocast(enabled=True, recipe=recipe):
            return train(args)
    return train(args)


if __name__ == "__main__":
    main()
