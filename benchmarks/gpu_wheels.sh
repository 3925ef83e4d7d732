#!/usr/bin/env bash
# Download the wheels a GPU machine without a package registry needs to run benchmarks/gpu_check.py.
#
# Run here (a machine that reaches the package registry), in the checkout:
#     bash benchmarks/gpu_wheels.sh            # PYTHON=... to pick the interpreter whose pip downloads
# It fills .whl/ (ignored by git, carried with the checkout by the device tool) with the exact
# CPython 3.12 manylinux x86_64 wheels of the packages the GPU image lacks, then prints the file
# list and the total size. On the GPU machine (torch 2.11 + CUDA 13, numpy, h5py, psutil, pytest
# already there), docs/gpu.md gives the one command that installs them and runs the check.
#
# Why these versions:
#   nvidia-nvcomp-cu13 / nvidia-libnvcomp-cu13 6.0.0.12  the nvCOMP the GPU path was written against
#   zstandard 0.25.0, lz4 4.4.5                           the CPU codecs (the same versions as here)
#   tensordict 0.15.3                                     pure Python, needs torch >= 2.11 (the image's);
#                                                         0.14.x carries a C extension built for older torch
#   pyvers 0.2.3, cloudpickle 3.1.3                       tensordict 0.15.3's own dependencies
#                                                         (numpy and torch are in the image)
#   pytest-timeout 2.4.0                                  bounds each test of gpu_check's `tests` stage
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=.whl
PACKAGES=(
  nvidia-nvcomp-cu13==6.0.0.12
  nvidia-libnvcomp-cu13==6.0.0.12
  zstandard==0.25.0
  lz4==4.4.5
  tensordict==0.15.3
  pyvers==0.2.3
  cloudpickle==3.1.3
  pytest-timeout==2.4.0
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

mkdir -p "$DEST"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
# One download per package: --no-deps keeps pip from pulling torch or numpy (already on the GPU
# machine), and a failure names the package that failed.
for pkg in "${PACKAGES[@]}"; do
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform_args[@]}" -d "$DEST" "$pkg"
done

# Only the pinned wheels travel: older downloads of other versions are left out of the count
# (and should be deleted, since the GPU command installs .whl/*.whl).
echo "wheels in $DEST/:"
total=0
stray=0
for f in "$DEST"/*.whl; do
  size=$(stat -c %s "$f")
  total=$((total + size))
  name=$(basename "$f")
  wanted=no
  for pkg in "${PACKAGES[@]}"; do
    stem="${pkg%%==*}"; stem="${stem//-/_}"; version="${pkg##*==}"
    case "$name" in "${stem}-${version}-"*) wanted=yes ;; esac
  done
  [ "$wanted" = yes ] || { stray=$((stray + 1)); name="$name   <- not pinned here: delete it"; }
  printf '  %10d  %s\n' "$size" "$name"
done
printf 'total: %d bytes (%.1f MiB) in %d wheels; the device tool carries at most 64 MiB with the checkout\n' \
  "$total" "$(echo "$total / 1048576" | bc -l)" "$(ls "$DEST"/*.whl | wc -l)"
[ "$stray" -eq 0 ] || { echo "error: $stray wheel(s) in $DEST/ are not pinned by this script" >&2; exit 1; }
