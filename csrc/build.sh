#!/usr/bin/env bash
# Build the native reader/validator: libsft_idx.so and sft_idx_check.
#
#   bash csrc/build.sh [OUTDIR]        # default OUTDIR: build/native (relative to the repo root)
#
# Environment: CXX (default g++), CXXFLAGS (default -O2), SANITIZE=1 adds
# -fsanitize=address,undefined (both outputs; load the .so only from a process
# started with the ASan runtime preloaded, or use the CLI).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/../build/native}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

cxx="${CXX:-g++}"
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "build.sh: C++ compiler '$cxx' not found (install g++ or set CXX)" >&2
  exit 2
fi
flags=(-std=c++17 ${CXXFLAGS:--O2} -fPIC -Wall -Wextra -Wshadow -Werror=return-type)
if [[ "${SANITIZE:-0}" == "1" ]]; then
  flags+=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g)
fi
srcs=(sft_idx.cpp sft_idx_structure.cpp sft_idx_json.cpp sft_idx_validate.cpp sft_idx_c.cpp)

objdir="$(mktemp -d "$out/.obj.XXXXXX")"
trap 'rm -rf "$objdir"' EXIT
pids=()
for src in "${srcs[@]}"; do
  "$cxx" "${flags[@]}" -c "$here/$src" -o "$objdir/${src%.cpp}.o" & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if [[ $status -ne 0 ]]; then
  echo "build.sh: compilation failed" >&2
  exit 1
fi
objs=("$objdir"/*.o)

# Build to temporary names and rename, so a concurrent loader never maps a half-written file.
"$cxx" "${flags[@]}" -shared -o "$out/.libsft_idx.so.tmp" "${objs[@]}" -lz
"$cxx" "${flags[@]}" -o "$out/.sft_idx_check.tmp" "$here/sft_idx_check.cpp" "${objs[@]}" -lz
mv -f "$out/.libsft_idx.so.tmp" "$out/libsft_idx.so"
mv -f "$out/.sft_idx_check.tmp" "$out/sft_idx_check"
echo "$out/libsft_idx.so"
echo "$out/sft_idx_check"
