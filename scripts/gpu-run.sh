#!/usr/bin/env bash
# Runs on the GPU host (no Rust there): the GPU tests, then the GEMM and layer benchmarks, from the
# stripped binaries that scripts/build-gpu-bins.sh put in gpu-bin/. Logs go to $OUT.
#   usage: bash scripts/gpu-run.sh [all|tests|test BINARY...|gemm|gemv|gemv-profile|spgemm|spgemm-compact|spgemm-profile|layer|quant|host|decode|fusion|attention|model|collective|profile|generate] [extra args...]
# (`model` runs the model_throughput example; `collective` the collective_timing example; `profile` runs it under Nsight Compute with
# `--profile-decode` (one variant, one decode batch) and sums the kernels of that step; `quant` the quant+lift layouts alone; `host` the
# host cost of each piece of a decode forward; `decode` a whole block at decode sizes, wall
# and device time; `generate` the main job (the generate example with --device cuda) twice,
# the second run on the first one's cached kernels; `all` runs
# tests, gemm and layer.)
set -u
OUT=${OUT:-/tmp/slidesparse-out}
mkdir -p "$OUT"
export CUDA_PATH=/usr/local/cuda
# The GPU hosts keep NVLink multicast off in NCCL (it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0
# burn's own all-reduce (`BurnRanks`, collective_timing's burn methods) loads NCCL through
# cudarc, which looks for libnccl.so and never the pip wheel's libnccl.so.2: link it under
# that name (NcclRanks finds libnccl.so.2 itself).
for lib in /opt/*/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2 \
           /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2; do
  if [ -f "$lib" ]; then
    mkdir -p /tmp/slidesparse-nccl && ln -sf "$lib" /tmp/slidesparse-nccl/libnccl.so
    export LD_LIBRARY_PATH=/tmp/slidesparse-nccl:${LD_LIBRARY_PATH:-}
    break
  fi
done
# cuBLASLt and NVRTC; cuSPARSELt is found by the library's own search (pip location).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export SLIDESPARSE_CACHE_DIR=${SLIDESPARSE_CACHE_DIR:-$OUT/cache}
# cuSPARSELt algorithms found by earlier runs (carry bench-cache/, git-ignored; merge the
# $OUT/cache/cusparselt-algorithms.json handed back into it).
if [ -f bench-cache/cusparselt-algorithms.json ] && [ ! -f "$SLIDESPARSE_CACHE_DIR/cusparselt-algorithms.json" ]; then
  mkdir -p "$SLIDESPARSE_CACHE_DIR" && cp bench-cache/cusparselt-algorithms.json "$SLIDESPARSE_CACHE_DIR/"
fi
# SmolLM2 (SMOLLM2_GGUF=FILE, e.g. the GGUF put together under /root/stash) where the example
# and gpu-generate-tests look for it.
if [ -n "${SMOLLM2_GGUF:-}" ]; then
  mkdir -p ~/.cache/burn-slidesparse/smollm2
  ln -sf "$(realpath "$SMOLLM2_GGUF")" ~/.cache/burn-slidesparse/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
what=${1:-all}
shift || true
# The binaries travel xz-compressed (the device tool carries at most 64 MiB).
if [ -f gpu-bin/gpu-bin.tar.xz ] && [ ! -x gpu-bin/gpu-tests ]; then
  tar -C gpu-bin -xJf gpu-bin/gpu-bin.tar.xz
fi
# CubeCL keeps its autotune results and compiled kernels under target/ (the GPU host has no
# cargo, so target/ holds nothing else). burn's bf16 matmul autotunes every new shape, ~20 s
# each at small M: restore the caches of earlier runs (carry gpu-cache/, git-ignored) and
# hand them back as $OUT/gpu-cache.tar.gz at the end (unpack into gpu-cache/ here).
if [ -d gpu-cache/target ]; then
  mkdir -p target && cp -r gpu-cache/target/. target/
fi
save_caches() { [ -d target ] && tar -czf "$OUT/gpu-cache.tar.gz" target; }
trap save_caches EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [ "$what" = all ] || [ "$what" = tests ]; then
  for t in gpu-tests gpu-attention-tests gpu-block-ops-tests gpu-tensor-parallel-tests gpu-decode-tests gpu-permuted-tests gpu-compact-gemm-tests gpu-generate-tests; do
    ./gpu-bin/$t --ignored --nocapture --test-threads=1 > "$OUT/$t.log" 2>&1
    echo "$t exit code: $?"
    grep -E "^test |test result|panicked|rel err|error" "$OUT/$t.log" | tail -30
  done
fi
if [ "$what" = test ]; then
  # Only the GPU test binaries named after `test` (e.g. gpu-compact-gemm-tests), as `tests` runs them.
  for t in "$@"; do
    ./gpu-bin/$t --ignored --nocapture --test-threads=1 > "$OUT/$t.log" 2>&1
    echo "$t exit code: $?"
    grep -E "^test |test result|panicked|rel err|error|bit-identical" "$OUT/$t.log" | tail -40
  done
fi
for mode in gemm layer quant host decode fusion attention; do
  if { [ "$what" = all ] && [ $mode != quant ] && [ $mode != host ] && [ $mode != decode ] && [ $mode != fusion ] && [ $mode != attention ]; } || [ "$what" = $mode ]; then
    ./gpu-bin/slidesparse-bench $mode --json "$OUT/$mode.json" "$@" > "$OUT/$mode.md" 2> "$OUT/$mode.err"
    echo "$mode bench exit code: $?"
    tail -3 "$OUT/$mode.err"
    cat "$OUT/$mode.md"
  fi
done
if [ "$what" = gemv ]; then
  # The decode GEMV kernels alone (burn-slidesparse/src/cuda/kernels/decode_gemv.cu), built with
  # the host's nvcc: checked bit for bit against the CPU, timed against cuBLASLt and a plain read.
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp \
    -I burn-slidesparse/src/cuda/kernels scripts/bench-gemv.cu -lcublasLt -o /tmp/bench-gemv \
    > "$OUT/gemv.err" 2>&1 && /tmp/bench-gemv > "$OUT/gemv.md" 2>> "$OUT/gemv.err"
  echo "gemv bench exit code: $?"
  tail -3 "$OUT/gemv.err"
  cat "$OUT/gemv.md"
fi
if [ "$what" = gemv-profile ]; then
  # Nsight Compute on the decode GEMV kernels (dense, tiles, rows), each one's checked launch:
  # GEMV_SHAPES (default "llama gate_up") at GEMV_MS tokens (default 1,8). Instructions, shared
  # loads and their bank conflicts, L2 sectors, DRAM bytes and throughput, stalls.
  nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp \
    -I burn-slidesparse/src/cuda/kernels scripts/bench-gemv.cu -lcublasLt -o /tmp/bench-gemv \
    > "$OUT/gemv-profile.err" 2>&1
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  GEMV_SHAPES=${GEMV_SHAPES:-llama gate_up} GEMV_MS=${GEMV_MS:-1,8} GEMV_CHECK_ONLY=1 \
    timeout 400 "$ncu" --kernel-name regex:gemv_ --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \
    -o "$OUT/gemv" /tmp/bench-gemv > "$OUT/gemv-profile.md" 2>> "$OUT/gemv-profile.err"
  echo "gemv profile exit code: $?"
  "$ncu" --import "$OUT/gemv.ncu-rep" --page details > "$OUT/gemv-profile-details.txt" 2>> "$OUT/gemv-profile.err"
  grep -E "^  gemv_|Duration|DRAM Throughput|bank_conflicts|inst_executed|dram__bytes_read|lts__t_sectors|No Eligible|Registers Per" \
    "$OUT/gemv-profile-details.txt" | head -120
fi
if [ "$what" = spgemm ]; then
  # The Hopper 2:4 sparse INT8 GEMM (burn-slidesparse/src/cuda/kernels/sparse_gemm_sm90.cu), built
  # with the host's nvcc: checked exactly against the CPU and cuBLASLt, timed against cuBLASLt's
  # dense INT8 GEMM (extra args go to the binary, e.g. --check-only). A kernel that waits forever on
  # an mbarrier would hang the call: the binary gets SPGEMM_TIMEOUT_S seconds (default 300).
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -Xcompiler -fopenmp \
    -I burn-slidesparse/src/cuda/kernels scripts/bench-spgemm.cu -lcublasLt -o /tmp/bench-spgemm \
    > "$OUT/spgemm.err" 2>&1 && timeout "${SPGEMM_TIMEOUT_S:-300}" /tmp/bench-spgemm "$@" > "$OUT/spgemm.md" 2>> "$OUT/spgemm.err"
  rc=$?
  echo "spgemm bench exit code: $rc"
  if [ "$rc" = 3 ]; then
    # A kernel hung or faulted (the bench names it in /tmp/bench-spgemm.hung and exits 3): the rest
    # of the run without it.
    grep -E "HUNG|FAULT" "$OUT/spgemm.err"
    mv "$OUT/spgemm.md" "$OUT/spgemm-hung.md"
    timeout "${SPGEMM_TIMEOUT_S:-300}" /tmp/bench-spgemm --no-cluster "$@" > "$OUT/spgemm.md" 2>> "$OUT/spgemm.err"
    echo "spgemm bench --no-cluster exit code: $?"
  fi
  grep -E "error|warning|registers|spill" "$OUT/spgemm.err" | head -20
  tail -3 "$OUT/spgemm.err"
  cat "$OUT/spgemm.md"
  # The instruction's own ceiling: dense and sparse wgmma from shared memory, no loads.
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I burn-slidesparse/src/cuda/kernels scripts/bench-wgmma-peak.cu -o /tmp/bench-wgmma-peak \
    > "$OUT/wgmma-peak.err" 2>&1 && /tmp/bench-wgmma-peak > "$OUT/wgmma-peak.md" 2>> "$OUT/wgmma-peak.err"
  echo "wgmma peak exit code: $?"
  tail -3 "$OUT/wgmma-peak.err"
  cat "$OUT/wgmma-peak.md"
fi
if [ "$what" = spgemm-compact ]; then
  # The compact kernels beside ws n256 k128 (precomputed metadata) and cuBLASLt's dense INT8 GEMM
  # at K, every Llama shape at one M (default 4096; extra args go to the binary, e.g. --m 16384),
  # and the timing probes that split their cost: built with SPGEMM_COMPACT_PROBE=1 the compact
  # kernels skip the metadata expansion, =2 the rank loads too (wrong results, timed anyway).
  # SPGEMM_PROBES="0" runs the kernels alone.
  probes=${SPGEMM_PROBES:-0 1 2}
  for probe in $probes; do
    nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp -DSPGEMM_COMPACT_PROBE=$probe \
      -I burn-slidesparse/src/cuda/kernels scripts/bench-spgemm.cu -lcublasLt -o /tmp/bench-spgemm-p$probe \
      > "$OUT/spgemm-compact-p$probe.err" 2>&1 &
  done
  wait
  for probe in $probes; do
    m_args=("$@"); [ ${#m_args[@]} -eq 0 ] && m_args=(--m 4096)
    timeout "${SPGEMM_TIMEOUT_S:-300}" /tmp/bench-spgemm-p$probe "${m_args[@]}" > "$OUT/spgemm-compact-p$probe.md" 2>> "$OUT/spgemm-compact-p$probe.err"
    echo "probe $probe exit code: $? (0: the kernels; 1: no expansion; 2: no expansion, no rank loads)"
    # shape, M, ws n256 k128, compact, compact bf16, compact ring, compact jit (INT32, bf16, f16),
    # cuBLASLt dense at K (us)
    awk -F'|' -v p=$probe '/^\| llama .*\(/ {
      for (i = 1; i <= NF; i++) { gsub(/^ +| +$/, "", $i) }
      printf "p%s %s M=%s: ws n256 k128 %s, compact %s, compact bf16 %s, compact ring %s, compact jit %s / bf16 %s / f16 %s, cuBLASLt K %s us\n", p, $2, $4, $8, $14, $15, $16, $17, $18, $19, $23 }' \
      "$OUT/spgemm-compact-p$probe.md"
  done
  grep -hE "checks exact|FAILED" "$OUT"/spgemm-compact-p0.md
fi
if [ "$what" = spgemm-profile ]; then
  # Nsight Compute on the ws n256 k128 sparse GEMM: every Llama 6:8 shape at M = 1024 / 4096 / 16384,
  # raster group 1 (token tiles fastest) and 16, after the usual checks. Sections: throughput of
  # SM / memory / L2 / DRAM, the memory chart, warp stalls, occupancy; the CSV keeps every metric.
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -Xcompiler -fopenmp \
    -I burn-slidesparse/src/cuda/kernels scripts/bench-spgemm.cu -lcublasLt -o /tmp/bench-spgemm \
    > "$OUT/spgemm-profile.err" 2>&1
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  timeout "${SPGEMM_TIMEOUT_S:-500}" "$ncu" --profile-from-start off --clock-control none \
    --kernel-name regex:spgemm_ws --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats -o "$OUT/spgemm" \
    /tmp/bench-spgemm --profile "$@" > "$OUT/spgemm-profile.md" 2>> "$OUT/spgemm-profile.err"
  echo "spgemm profile exit code: $?"
  "$ncu" --import "$OUT/spgemm.ncu-rep" --page raw --csv > "$OUT/spgemm-profile.csv" 2>> "$OUT/spgemm-profile.err"
  "$ncu" --import "$OUT/spgemm.ncu-rep" --page details > "$OUT/spgemm-profile-details.txt" 2>> "$OUT/spgemm-profile.err"
  grep -E "spgemm_ws|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L2 Hit Rate" \
    "$OUT/spgemm-profile-details.txt" | head -150
  tail -3 "$OUT/spgemm-profile.err"
fi
if [ "$what" = profile ]; then
  ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --print-units base \
    ./gpu-bin/model_throughput --profile-decode "$@" > "$OUT/profile.csv" 2> "$OUT/profile.err"
  echo "profile exit code: $?"
  tail -3 "$OUT/profile.err"
  python3 scripts/ncu-kernel-summary.py "$OUT/profile.csv"
fi
if [ "$what" = collective ]; then
  ./gpu-bin/collective_timing "$@" > "$OUT/collective.md" 2> "$OUT/collective.err"
  echo "collective timing exit code: $?"
  tail -8 "$OUT/collective.err"
  cat "$OUT/collective.md"
fi
if [ "$what" = generate ]; then
  # The example keeps cubecl's compiled kernels and autotune results in
  # $SLIDESPARSE_CACHE_DIR/cubecl (handed back under $OUT/cache): the second run's warm-up is
  # the one a user sees from the second run on. Extra args go to the example (--pattern 6:8
  # --prompt "Once upon a time"; SmolLM2 from SMOLLM2_GGUF or --gguf FILE).
  for run in 1 2; do
    ./gpu-bin/generate --device cuda "$@" > "$OUT/generate-$run.md" 2> "$OUT/generate-$run.err"
    echo "generate run $run exit code: $?"
    tail -3 "$OUT/generate-$run.err"
    cat "$OUT/generate-$run.md"
  done
fi
if [ "$what" = model ]; then
  # `--backend both` and `--tensor-parallel` print their own table and take no --json.
  json=(--json "$OUT/model.json")
  case " $* " in *" both "*|*" --tensor-parallel "*) json=() ;; esac
  ./gpu-bin/model_throughput "${json[@]}" "$@" > "$OUT/model.md" 2> "$OUT/model.err"
  echo "model throughput exit code: $?"
  tail -3 "$OUT/model.err"
  cat "$OUT/model.md"
fi
