#!/usr/bin/env bash
# Builds the stripped release binaries for the GPU host into gpu-bin/ (git-ignored):
# gpu-tests (the #[ignore]d GPU tests), slidesparse-bench, the model_throughput and
# pack_timing examples, plus gpu-bin/gpu-bin.tar.xz holding them all (carry that one alone).
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
cargo build --release -p burn-slidesparse --features cuda,cli --bin slidesparse-bench
cargo build --release -p slidesparse-examples --features cuda --example model_throughput --example pack_timing
cp target/release/slidesparse-bench target/release/examples/model_throughput target/release/examples/pack_timing gpu-bin/
rm -f gpu-bin/slidesparse
# The device tool carries at most 64 MiB: ship the binaries xz-compressed (gpu-run.sh unpacks).
tar -C gpu-bin -cJf gpu-bin.tar.xz gpu-tests slidesparse-bench model_throughput pack_timing
mv gpu-bin.tar.xz gpu-bin/
ls -la gpu-bin
