"""Loss curves of examples/train_lm.py with and without FP8 (issue #27: final loss within 1% of bf16).

Run on the GPU machine from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.fp8_train_curves --steps 300 | tee $OUT/log.txt
Each recipe trains in its own subprocess (same seed, data and schedule): `--preset gpu --steps N` plus
`--fp8 <recipe>` (none = bf16). Writes $OUT/fp8_train_curves.json (losses per step, eval loss, tokens/s) and, where
matplotlib is installed, $OUT/fp8_train_curves.png; `--plot-only FILE.json` redraws the PNG from a JSON elsewhere.
CPU smoke test: PYTHONPATH=. python -m benchmarks.fp8_train_curves --cpu-smoke
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("none", "delayed", "current", "block")


def one_run(recipe, steps, smoke):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_lm

    args = ["--steps", str(steps), "--no-progress", "--no-ckpt", "--no-plot", "--sample-len", "0",
            "--no-compile-cache", "--log-every", "10", "--out-dir", os.path.join("/tmp", f"fp8_curve_{recipe}")]
    args += (["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--seq-len", "64", "--batch", "4",
              "--eval-batches", "1", "--eval-every", "0"] if smoke else ["--preset", "gpu"])
    if recipe != "none":
        args += ["--fp8", recipe]
    out = train_lm.main(args)
    return {"losses": {int(k): float(v) for k, v in out["losses"].items()}, "eval_loss": float(out["eval_loss"]),
            "tokens_per_s": out.get("tokens_per_s")}


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in res["runs"].items():
        steps = sorted(r["losses"], key=int)
        ax.plot([int(s) for s in steps], [r["losses"][s] for s in steps],
                label=f"{'bf16' if name == 'none' else 'FP8 ' + name} (final eval {r['eval_loss']:.4f})", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title(f"train_lm --preset gpu, bf16 vs FP8 — {res['device']}, jax {res['jax']}, {res['date']}", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--plot-only", help="redraw the PNG from this JSON and exit")
    a = ap.parse_args()
    if a.plot_only:
        res = json.load(open(a.plot_only))
        print(plot(res, a.plot_only.replace(".json", ".png")))
        return
    if a.one:
        print("RESULT " + json.dumps(one_run(a.one, a.steps, a.cpu_smoke)), flush=True)
        return
    import jax
    out_dir = os.environ.get("OUT", "/tmp")
    res = {"date": str(datetime.date.today()), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "steps": a.steps, "runs": {}}
    for recipe in a.recipes.split(","):
        cmd = [sys.executable, "-m", "benchmarks.fp8_train_curves", "--one", recipe, "--steps", str(a.steps)]
        cmd += ["--cpu-smoke"] if a.cpu_smoke else []
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"FAILED {recipe}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}", flush=True)
            continue
        res["runs"][recipe] = json.loads(line[0][len("RESULT "):])
        print(f"{recipe}: {[ln for ln in p.stdout.splitlines() if ln.startswith('step')][-3:]}", flush=True)
    base = res["runs"].get("none")
    print(f"\n## train_lm, bf16 vs FP8, {a.steps} steps — {res['date']}, {res['device']}, jax {res['jax']}\n")
    print("| run | final train loss (mean of last 5 logged) | eval loss | vs bf16 eval | tokens/s |")
    print("|---|---|---|---|---|")
    for name, r in res["runs"].items():
        last = [r["losses"][k] for k in sorted(r["losses"], key=int)[-5:]]
        rel = (r["eval_loss"] / base["eval_loss"] - 1) if base else float("nan")
        tps = r.get("tokens_per_s")
        print(f"| {'bf16' if name == 'none' else 'FP8 ' + name} | {sum(last) / len(last):.4f} | {r['eval_loss']:.4f} "
              f"| {rel * 100:+.2f}% | {tps if tps is None else f'{tps:,.0f}'} |")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "fp8_train_curves.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}; png: {plot(res, path.replace('.json', '.png'))}")


if __name__ == "__main__":
    main()
