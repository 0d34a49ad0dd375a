#!/usr/bin/env bash
# Download the optional benchmark peers as wheels for the GPU machine (Python 3.12, x86-64, no
# network there) into .whl/ (ignored by git; name it in the device call's carry: [".whl"]).
# Run here, from anywhere:  bash benchmarks/fetch_peer_wheels.sh [DEST]   (DEST defaults to .whl)
#
# tokamax 0.0.17 needs jax >= 0.11.1 and Python >= 3.12, so it only runs on the GPU machine.
# Its Requires-Dist that the GPU image already has are NOT fetched: jax, jaxlib, jaxtyping,
# absl-py, tqdm, numpy, flax (for qwix), opt-einsum, packaging, protobuf.  xprof (a 32 MB wheel
# with many dependencies, only for tokamax's own profiler timing) is NOT fetched either: the
# benchmark puts a stand-in for `xprof.cli.tools` into sys.modules.  typing-extensions is fetched
# because pydantic 2.14 asks for >= 4.16 and the image's version is not recorded (4.15 also
# worked in a local import test).  Pins keep one version of each (two stop the install there).
# FlashAttention-3 for JAX (flash-attn3-jax 0.2.3, a 23 MB cp312 wheel with its CUDA kernels; needs einops) is
# the other attention peer: `flash_mha` / `flash_mha_varlen`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PKGS=(
  tokamax==0.0.17
  einshape==1.0
  qwix==0.1.8
  immutabledict==4.3.1
  tensorboardx==2.6.5
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  flash-attn3-jax==0.2.3
  einops==0.8.1
)
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${PKGS[@]}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true

# Check: one version of each distribution, and every (non-extra) Requires-Dist either in DEST or
# known to be on the GPU image (or stood in for); then list sizes and the total.
python3 - "$DEST" <<'PY'
import email.parser, os, re, sys, zipfile
dest = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
ON_IMAGE = {"jax", "jaxlib", "jaxtyping", "absl-py", "tqdm", "numpy", "flax", "opt-einsum",
            "packaging", "protobuf", "typing-extensions", "ml-dtypes", "chex", "optax"}
STOOD_IN = {"xprof"}
whls = sorted(f for f in os.listdir(dest) if f.endswith(".whl"))
names = {}
for f in whls:
    names.setdefault(norm(f.split("-")[0]), []).append(f)
dups = {n: fs for n, fs in names.items() if len(fs) > 1}
missing = []
total = 0
for f in whls:
    with zipfile.ZipFile(os.path.join(dest, f)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = []
    for r in msg.get_all("Requires-Dist") or []:
        if "extra ==" in r or 'python_version < "3.7"' in r:
            continue
        n = norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0))
        reqs.append(n)
        if n not in names and n not in ON_IMAGE and n not in STOOD_IN:
            missing.append(f"{n} (needed by {f})")
    size = os.path.getsize(os.path.join(dest, f))
    total += size
    print(f"  {size / 2**20:6.2f} MiB  {f}   needs: {', '.join(reqs) or '-'}")
print(f"  {total / 2**20:6.2f} MiB  total, {len(whls)} wheels in {dest}/")
if dups:
    sys.exit(f"more than one version of: {dups}  (delete the extra ones)")
if missing:
    sys.exit(f"not fetched and not on the GPU image: {missing}")
print("ok: one version each; every requirement fetched, on the GPU image, or stood in (xprof)")
PY
