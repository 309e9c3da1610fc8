#!/usr/bin/env bash
# Unpacks the llama.cpp source tarball made by pack-llama-src.sh and builds, CPU only, the tools the
# GGUF fixtures need: llama-quantize, llama-imatrix, llama-gguf-split, and our llama-logits and
# dequant-goldens (scripts/gguf/*.cpp), built inside the tree against its libllama and ggml.
#   scripts/gguf/build-llama.sh SRC_TGZ WORK_DIR [extra cmake args]
# Leaves the sources in WORK_DIR/llama-src and the programs, with libllama.so and libggml.so beside
# them, in WORK_DIR/llama-src/build/bin (run them with LD_LIBRARY_PATH set to that folder).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tgz=$(readlink -f "$1"); work=$2; shift 2
mkdir -p "$work"; cd "$work"
rm -rf llama-src; tar xzf "$tgz"; cd llama-src
# Only the examples we need (the full list names folders that the tarball leaves out).
cat > examples/CMakeLists.txt <<'CM'
find_package(Threads REQUIRED)
include_directories(${CMAKE_CURRENT_SOURCE_DIR})
add_subdirectory(quantize)
add_subdirectory(imatrix)
add_subdirectory(gguf-split)
add_subdirectory(moe-fixtures)
CM
mkdir -p examples/moe-fixtures
cp "$here/llama_logits.cpp" "$here/dequant_goldens.cpp" examples/moe-fixtures/
cat > examples/moe-fixtures/CMakeLists.txt <<'CM'
add_executable(llama-logits llama_logits.cpp)
target_link_libraries(llama-logits PRIVATE llama ggml ${CMAKE_THREAD_LIBS_INIT})
target_compile_features(llama-logits PRIVATE cxx_std_17)
add_executable(dequant-goldens dequant_goldens.cpp)
target_link_libraries(dequant-goldens PRIVATE ggml ${CMAKE_THREAD_LIBS_INIT})
target_compile_features(dequant-goldens PRIVATE cxx_std_17)
CM
# pocs/ and tests/ are not in the tarball
sed -i 's|^    add_subdirectory(pocs)|    # add_subdirectory(pocs)|' CMakeLists.txt
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_CURL=OFF \
  -DGGML_IQK_FA_ALL_QUANTS=OFF -DBUILD_SHARED_LIBS=ON "$@" > cmake-configure.log 2>&1 || { tail -40 cmake-configure.log; exit 1; }
cmake --build build -j"$(nproc)" --target llama-quantize llama-imatrix llama-gguf-split llama-logits dequant-goldens
find build -name '*.so*' -exec cp -P {} build/bin/ \;
ls -l build/bin
