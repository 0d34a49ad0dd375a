#!/usr/bin/env bash
# On the GPU machine, from the repo root, with the device call's carry [".whl"] (wheels made by
# benchmarks/fetch_peer_wheels.sh): install the optional benchmark peers (tokamax & co.) into
# /tmp/site (or $1) without touching the image's packages, then say what it did.  Afterwards:
#     export PYTHONPATH=.:/tmp/site
# Never fatal for the benchmark: with no wheels, or a failed install, the benchmark prints why
# tokamax is missing and falls back to README numbers.
set -u
cd "$(dirname "$0")/.."
TARGET=${1:-/tmp/site}
shopt -s nullglob
whls=(.whl/*.whl)
if [ ${#whls[@]} -eq 0 ]; then
  echo "install_peers: no wheels in .whl/ (fetch them with benchmarks/fetch_peer_wheels.sh and carry [\".whl\"]); nothing installed"
  exit 0
fi
echo "install_peers: installing ${#whls[@]} wheels into $TARGET:"
for w in "${whls[@]}"; do printf '  %6s KiB  %s\n' "$(( $(stat -c %s "$w") / 1024 ))" "$(basename "$w")"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "${whls[@]}"
rc=$?
if [ $rc -ne 0 ]; then
  echo "install_peers: pip install failed (rc $rc)"
  exit $rc
fi
# What tokamax needs from the image (not carried), and what the carried wheels gave, as seen with
# $TARGET first on the path (as the benchmark will see them).
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" python3 - "$TARGET" <<'PY'
import importlib.metadata as md, sys
target = sys.argv[1]
def show(names):
    out = []
    for n in names:
        try:
            d = md.distribution(n)
            where = "carried" if str(d.locate_file("")).startswith(target) else "image"
            out.append(f"{n} {d.version} ({where})")
        except md.PackageNotFoundError:
            out.append(f"{n} MISSING")
    return ", ".join(out)
print("install_peers: carried:", show(["tokamax", "einshape", "qwix", "immutabledict", "tensorboardx",
      "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"]))
print("install_peers: from the image:", show(["jax", "jaxlib", "flax", "jaxtyping", "absl-py", "tqdm",
      "numpy", "opt-einsum", "packaging", "protobuf"]))
print(f"install_peers: done; now export PYTHONPATH=.:{target}")
PY
