#!/usr/bin/env bash
# Build llama.cpp once from the vendored sources of the pinned llama-cpp-python sdist:
# its shared libraries (libllama, libggml*: what the ggml backend loads through
# llama-cpp-python) and the tools the audit and the benchmarks run beside verispec
# (llama-server, llama-bench). The result is cached outside the repo:
#   ${VERISPEC_CACHE:-~/.cache/verispec}/llama.cpp/<version>/{bin,lib}
# and a second run with the result present returns at once. Prints the bin folder.
#
# About 5-20 minutes on 2 cores (cmake 3.25, gcc 12). CPU only, -march=native, less AMX:
# on a CPU with AMX (Sapphire Rapids and later) a native build also compiles ggml's AMX
# buffer type, which repacks Q4_K weights and crashes in ggml_backend_amx_mul_mat on the
# first pass of more than one token (llama-server at start-up, llama-bench -p 8, every
# verify pass and prefill of the ggml backend; ggml-org/llama.cpp#20824, closed unfixed).
# -mno-amx-* keeps the rest of -march=native (AVX-512, VNNI) and drops that path; GCC lets
# an explicit -mno-* win over -march whatever their order. The flags are stamped into the
# cache (build-flags), and a cached build made with other flags is rebuilt.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# the rule of verispec/paths.py: $VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec
CACHE="${VERISPEC_CACHE:-${XDG_CACHE_HOME:+$XDG_CACHE_HOME/verispec}}"
CACHE="${CACHE:-$HOME/.cache/verispec}"
OUT="$CACHE/llama.cpp/$VERSION"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
ISA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
STAMP="cmake: GGML_NATIVE=ON BUILD_SHARED_LIBS=ON; cflags: $ISA_FLAGS"
if [ -x "$OUT/bin/llama-server" ] && [ -x "$OUT/bin/llama-bench" ] && [ -f "$OUT/lib/libllama.so" ] \
   && [ "$(cat "$OUT/build-flags" 2>/dev/null)" = "$STAMP" ]; then
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
  -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON \
  -DCMAKE_C_FLAGS="$ISA_FLAGS" -DCMAKE_CXX_FLAGS="$ISA_FLAGS" >&2
echo "build_llama_cpp: building with -j$JOBS (10-20 min on 2 cores)" >&2
start=$(date +%s)
cmake --build "$BUILD" -j"$JOBS" --target llama llama-server llama-bench >&2
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib"
cp -a "$BUILD"/bin/llama-server "$BUILD"/bin/llama-bench "$OUT/bin/"
find "$BUILD" -name '*.so*' \( -type f -o -type l \) -exec cp -a {} "$OUT/lib/" \;
# the tools find the libraries beside them or in lib/
for so in "$OUT"/lib/*.so*; do ln -sf "../lib/$(basename "$so")" "$OUT/bin/$(basename "$so")"; done
echo "$STAMP" > "$OUT/build-flags"
echo "build_llama_cpp: built in $(( $(date +%s) - start )) s" >&2
echo "$OUT/bin"
