#!/usr/bin/env bash
# A wheelhouse for a GPU host without a package index: vLLM's CUDA stack as locked in
# deploy/requirements-cuda.txt (hashes checked at install) and this project's wheel, for Linux
# x86_64 and the image's Python, in one tarball, optionally split into parts of a given size (for
# transfers that limit a file's size). Run it where PyPI is reachable.
#
# Usage: bash scripts/offline-bundle.sh [--out DIR] [--python 3.11] [--split SIZE]   (SIZE as for split -b, e.g. 40M)
# On the GPU host:  cat DIR/parts/* | tar -x   (or tar -xf DIR/bundle.tar), then  bash bundle/install.sh [--target DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=offline-bundle py=3.11 split_size=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --split) split_size=$2; shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bundle/whl" "$out"
plat=(--only-binary=:all: --python-version "$py" --implementation cp)
for p in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  plat+=(--platform "${p}_x86_64")
done
python3 -m pip download -q "${plat[@]}" --no-deps --require-hashes -r deploy/requirements-cuda.txt -d "$stage/bundle/whl"
python3 -m pip wheel -q --no-deps . -w "$stage/bundle/whl"
cp deploy/requirements-cuda.txt "$stage/bundle/"
cat > "$stage/bundle/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Installs the bundled wheels without an index: bash install.sh [--target DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install --no-index --find-links "$here/whl" --require-hashes -r "$here/requirements-cuda.txt" "$@"
python3 -m pip install --no-index --no-deps "$here"/whl/qwen4exp_serve-*.whl "$@"
INSTALL
tar -cf "$out/bundle.tar" -C "$stage" bundle
if [ -n "$split_size" ]; then
  mkdir -p "$out/parts" && rm -f "$out/parts/"*
  split -b "$split_size" -d -a 3 "$out/bundle.tar" "$out/parts/part."
  rm "$out/bundle.tar"
  echo "$(ls "$out/parts" | wc -l) parts in $out/parts; on the host: cat parts/* | tar -x && bash bundle/install.sh"
else
  echo "$out/bundle.tar; on the host: tar -xf bundle.tar && bash bundle/install.sh"
fi
