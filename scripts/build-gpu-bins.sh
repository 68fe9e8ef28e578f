#!/usr/bin/env bash
# Builds the stripped release binaries for the GPU host into gpu-bin/ (git-ignored):
# gpu-tests, gpu-attention-tests, gpu-block-ops-tests, gpu-tensor-parallel-tests, gpu-decode-tests, gpu-permuted-tests, gpu-compact-gemm-tests, gpu-generate-tests (the #[ignore]d GPU tests), slidesparse-bench, the model_throughput,
# collective_timing, pack_timing and generate examples, plus gpu-bin/gpu-bin.tar.xz holding them all (carry that one alone).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p gpu-bin
# The GPU test binaries: the layer suite (gpu), the attention kernels, the block steps, the
# NCCL collectives and split layers, the decode GEMV and graph.
cargo test --release -p slidesparse-tests --features cuda --test gpu --test gpu_attention \
  --test gpu_block_ops --test gpu_tensor_parallel --test gpu_decode --test gpu_permuted --test gpu_compact_gemm --no-run --message-format=json \
  | python3 -c 'import json, shutil, sys
names = {"gpu": "gpu-tests", "gpu_attention": "gpu-attention-tests", "gpu_block_ops": "gpu-block-ops-tests",
         "gpu_tensor_parallel": "gpu-tensor-parallel-tests", "gpu_decode": "gpu-decode-tests",
         "gpu_permuted": "gpu-permuted-tests", "gpu_compact_gemm": "gpu-compact-gemm-tests"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in names:
        shutil.copy(m["executable"], "gpu-bin/" + names[m["target"]["name"]])'
# The example model's GPU test (an example-crate test: the model packed once on the CPU, its
# logits on the GPU, forward and decode graph).
cargo test --release -p slidesparse-examples --features cuda --test gpu_generate --no-run --message-format=json \
  | python3 -c 'import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_generate":
        shutil.copy(m["executable"], "gpu-bin/gpu-generate-tests")'
cargo build --release -p burn-slidesparse --features cuda,cli --bin slidesparse-bench
cargo build --release -p slidesparse-examples --features cuda --example model_throughput --example collective_timing --example pack_timing \
  --example generate
cp target/release/slidesparse-bench target/release/examples/model_throughput target/release/examples/collective_timing \
  target/release/examples/pack_timing target/release/examples/generate gpu-bin/
rm -f gpu-bin/slidesparse
# The device tool carries at most 64 MiB: ship the binaries xz-compressed (gpu-run.sh unpacks).
strip gpu-bin/gpu-tests gpu-bin/gpu-attention-tests gpu-bin/gpu-block-ops-tests gpu-bin/gpu-tensor-parallel-tests gpu-bin/gpu-decode-tests gpu-bin/gpu-permuted-tests gpu-bin/gpu-compact-gemm-tests gpu-bin/gpu-generate-tests gpu-bin/slidesparse-bench gpu-bin/model_throughput gpu-bin/collective_timing gpu-bin/pack_timing gpu-bin/generate
tar -C gpu-bin -cJf gpu-bin.tar.xz gpu-tests gpu-attention-tests gpu-block-ops-tests gpu-tensor-parallel-tests gpu-decode-tests gpu-permuted-tests gpu-compact-gemm-tests gpu-generate-tests slidesparse-bench model_throughput collective_timing pack_timing generate
mv gpu-bin.tar.xz gpu-bin/
if [ "$(stat -c %s gpu-bin/gpu-bin.tar.xz)" -gt $((60 * 1024 * 1024)) ]; then
  echo "warning: gpu-bin/gpu-bin.tar.xz is over 60 MiB; one call carries 64 MiB in all" >&2
fi
ls -la gpu-bin
