#!/usr/bin/env bash
# Runs on the GPU host: Nsight Compute over the quant+lift kernels of `slidesparse-bench quant`
# (one shape per call: the launches of every variant, check launch and timed calls), then a
# condensed per-launch table of the metrics that say what bounds a memory-bound kernel.
#   usage: bash scripts/profile-quant.sh NAME [slidesparse-bench quant args...]
# Writes $OUT/NAME.ncu-rep, $OUT/NAME-details.txt, $OUT/NAME-raw.csv and $OUT/NAME-summary.txt.
set -u
OUT=${OUT:-/tmp/slidesparse-out}
name=$1
shift
export CUDA_PATH=/usr/local/cuda
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [ -f gpu-bin/gpu-bin.tar.xz ] && [ ! -x gpu-bin/slidesparse-bench ]; then
  tar -C gpu-bin -xJf gpu-bin/gpu-bin.tar.xz
fi
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
"$ncu" --clock-control none --kernel-name regex:quant_lift --launch-count "${NCU_LAUNCHES:-40}" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section SourceCounters --import-source no \
  -f -o "$OUT/$name" ./gpu-bin/slidesparse-bench quant --reps 1 "$@" > "$OUT/$name-run.log" 2>&1
echo "ncu exit code: $?"
"$ncu" --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name-details.txt" 2>&1
"$ncu" --import "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/$name-raw.csv" 2>&1
# SASS with per-instruction issue and stall samples of the first grouped launch: where the
# instructions and the waits are.
"$ncu" --import "$OUT/$name.ncu-rep" --kernel-name regex:grouped --launch-count 1 --page source \
  --print-source sass --csv > "$OUT/$name-sass.csv" 2>&1
grep -E "^  [a-z_]+_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Block Limit Registers|Grid Size|Block Size|Stall Long|One or More Eligible|Executed Instructions |L1/TEX Hit|L2 Hit|Mem Busy|Memory Throughput" \
  "$OUT/$name-details.txt" | head -400 > "$OUT/$name-summary.txt"
wc -l "$OUT/$name-summary.txt"
