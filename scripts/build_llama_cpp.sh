#!/usr/bin/env bash
# Build llama.cpp once from the vendored sources of the pinned llama-cpp-python sdist:
# its shared libraries (libllama, libggml*: what the ggml backend loads through
# llama-cpp-python) and the tools the audit and the benchmarks run beside verispec
# (llama-server, llama-bench). The result is cached outside the repo:
#   ${VERISPEC_CACHE:-~/.cache/verispec}/llama.cpp/<version>/{bin,lib}
# and a second run with the result present returns at once. Prints the bin folder.
#
# About 10-20 minutes on 2 cores (cmake 3.25, gcc 12). CPU only, -march=native.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${VERISPEC_CACHE:-$HOME/.cache/verispec}"
OUT="$CACHE/llama.cpp/$VERSION"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
if [ -x "$OUT/bin/llama-server" ] && [ -x "$OUT/bin/llama-bench" ] && [ -f "$OUT/lib/libllama.so" ]; then
  echo "$OUT/bin"
  exit 0
fi
SRC="$CACHE/src"
mkdir -p "$SRC"
SDIST="$SRC/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC" >&2
fi
if [ ! -d "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp" ]; then
  tar -xzf "$SDIST" -C "$SRC"
fi
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$CACHE/llama.cpp/build-$VERSION"
echo "build_llama_cpp: configuring $LLAMA into $BUILD" >&2
cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON >&2
echo "build_llama_cpp: building with -j$JOBS (10-20 min on 2 cores)" >&2
start=$(date +%s)
cmake --build "$BUILD" -j"$JOBS" --target llama llama-server llama-bench >&2
mkdir -p "$OUT/bin" "$OUT/lib"
cp -a "$BUILD"/bin/llama-server "$BUILD"/bin/llama-bench "$OUT/bin/"
find "$BUILD" -name '*.so*' \( -type f -o -type l \) -exec cp -a {} "$OUT/lib/" \;
# the tools find the libraries beside them or in lib/
for so in "$OUT"/lib/*.so*; do ln -sf "../lib/$(basename "$so")" "$OUT/bin/$(basename "$so")"; done
echo "build_llama_cpp: built in $(( $(date +%s) - start )) s" >&2
echo "$OUT/bin"
