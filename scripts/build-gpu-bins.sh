#!/usr/bin/env bash
# Builds the stripped release binaries for the GPU host into gpu-bin/ (git-ignored):
# gpu-tests (the #[ignore]d GPU tests) and slidesparse-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p gpu-bin
test_exe=$(cargo test --release -p slidesparse-tests --features cuda --test gpu --no-run --message-format=json \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
cp "$test_exe" gpu-bin/gpu-tests
cargo build --release -p burn-slidesparse --features cuda --bins
cp target/release/slidesparse-bench target/release/slidesparse gpu-bin/
ls -la gpu-bin
