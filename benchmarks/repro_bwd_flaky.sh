#!/usr/bin/env bash
# Repro of the flaky CUDA test failures seen at bcdf39e (H100; docs/EXPERIMENTS.md, "Flaky CUDA test
# failures"): D = 64 deterministic dq garbage, dv NaN. One device call: OUT=$OUT bash benchmarks/repro_bwd_flaky.sh
set -u
OUT=${OUT:-/tmp/out}
OUT=$OUT NCP_COMMIT=${NCP_COMMIT:-x} bash benchmarks/gpu_run.sh build > /dev/null 2>&1; tail -1 $OUT/summary.txt
P="python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_sink_attention_cuda.py"
for i in 1 2 3; do
  NCP_TEST_SEED=802486495 timeout 60 $P -k "auto-equal:513-T2100-8x2-d128-w513-dtype1" 2>&1 | tail -1
done
for i in 1 2; do timeout 90 $P -k "d64 and det" 2>&1 | tail -1; done
timeout 60 python3 benchmarks/diag_bwd_flaky.py 2>&1 | tail -14
NCP_TEST_SEED=802486495 timeout 150 compute-sanitizer --tool memcheck --kernel-regex kns=ncp --error-exitcode 99 \
  $P -k "auto-equal:513-T2100-8x2-d128-w513 or (d64 and det and matches_oracle and grid7)" > $OUT/san_repro.txt 2>&1
echo "memcheck exit $? $(grep -c 'Invalid\|ERROR SUMMARY' $OUT/san_repro.txt)"; grep -E "ERROR SUMMARY|Invalid|passed|failed" $OUT/san_repro.txt | tail -5
