#!/bin/bash
# The DeepSeek-V3 layer table, the GPU tests or the NVFP4 linear table on two Triton releases, one
# process per release, in one call on an
# H100/H200 whose torch pins Triton 3.6 (torch 2.11), the second release unpacked beside it:
#   bash benchmarks/run_triton_releases.sh bench /path/to/triton-3.9.0.tar.xz     # the layer table
#   bash benchmarks/run_triton_releases.sh tests /path/to/triton-3.9.0.tar.xz     # the GPU tests on both
#   bash benchmarks/run_triton_releases.sh linear /path/to/triton-3.9.0.tar.xz    # the NVFP4 linear table
# The archive holds a `triton/` package for this Python (see CONTRIBUTING.md); fp4moe's kernels
# run on it eagerly and under CUDA graphs. torch's own Inductor expects the Triton torch pins, so
# under the second release only the tests that do not compile with Inductor are run.
# Results and logs go to $OUT (default benchmarks/out).
set -o pipefail
step=${1:?usage: run_triton_releases.sh bench|tests|linear TRITON_ARCHIVE}
archive=${2:?usage: run_triton_releases.sh bench|tests|linear TRITON_ARCHIVE}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT" /tmp/second-triton
tar -xJf "$archive" -C /tmp/second-triton
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1  # (3.9 warns unless told: keep 3.6's default)
# TRITON_BACKENDS_IN_TREE: backends from the unpacked package, not the installed release's metadata
second() { PYTHONPATH=/tmp/second-triton:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1 "$@"; }
version() { python3 -c 'import triton; print(triton.__version__)'; }
first_v=$(version); second_v=$(second version)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
case $step in
  bench)
    # BENCH_TOKENS: other token counts; ORDER=reverse: the second release's process first
    args="--backends triton,triton_single_role,grouped_mm,reference --tokens ${BENCH_TOKENS:-1,8,64,512,2048,8192} --input-sets 8"
    order="$first_v $second_v"; [ "${ORDER:-}" = reverse ] && order="$second_v $first_v"
    for v in $order; do
      run=""; [ "$v" = "$second_v" ] && run=second
      $run timeout 280 python3 benchmarks/bench_moe.py $args --out "/tmp/bench-$v" 2>&1 | tee "$OUT/bench-triton-$v.log"
      cp "/tmp/bench-$v/results_deepseek.md" "$OUT/results_deepseek_triton-$v.md"
      cp "/tmp/bench-$v/results_deepseek.json" "$OUT/results_deepseek_triton-$v.json"
    done ;;
  linear)
    # BENCH_TOKENS: other token counts; LINEAR_SHAPES: a subset of bench_linear.SHAPES. Each log
    # names the kernel family the linears ran (fp4moe's info line)
    for v in $first_v $second_v; do
      run=""; [ "$v" = "$second_v" ] && run=second
      $run timeout ${LINEAR_TIMEOUT:-280} python3 benchmarks/bench_linear.py --tokens ${BENCH_TOKENS:-1,16,64,128,512,2048} \
        ${LINEAR_SHAPES:+--shapes "$LINEAR_SHAPES"} 2>&1 | tee "$OUT/linear-triton-$v.log"
    done ;;
  tests)
    files="tests/test_triton_backend.py tests/test_op.py tests/test_linear.py tests/test_routing.py"
    second timeout ${TESTS_TIMEOUT:-270} python3 -m pytest -q -m gpu -p no:cacheprovider $files 2>&1 | tee "$OUT/tests-triton-$second_v.log" | tail -15
    timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/tests-triton-$first_v.log" | tail -15 ;;
esac
