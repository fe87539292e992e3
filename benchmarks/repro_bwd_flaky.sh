#!/usr/bin/env bash
# Repro of the flaky CUDA test failures seen at bcdf39e (H100; docs/EXPERIMENTS.md, "Flaky CUDA test
# failures"): D = 64 deterministic dq garbage, dv NaN. One device call (about 5 minutes; carry .baseline to compare):
#   OUT=$OUT NCP_COMMIT=<sha> bash benchmarks/repro_bwd_flaky.sh
# Writes $OUT/summary.txt (the machine's GPU UUID first: the failures followed machines),
# $OUT/repro.txt and the sanitizer logs.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# With .baseline/ carried (an older tree, e.g. before the stale-dO fix), the poison probe runs on both.
STAGES="build"; [ -d .baseline ] && STAGES="build baseline"
OUT=$OUT NCP_COMMIT=${NCP_COMMIT:-x} bash benchmarks/gpu_run.sh $STAGES > /dev/null 2>&1; head -2 $OUT/summary.txt; tail -2 $OUT/summary.txt
P="python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_sink_attention_cuda.py"
mkdir -p build && nvcc -shared -Xcompiler -fPIC -o build/probe_stale_smem.so benchmarks/probe_stale_smem.cu
{
  if [ -d .baseline ]; then
    echo "== poison probe, .baseline"; (cd .baseline && timeout 120 python3 ../benchmarks/probe_stale_smem.py --runs 100 --lib ../build/probe_stale_smem.so 2>&1 | tail -12)
  fi
  echo "== poison probe, this tree"; timeout 120 python3 benchmarks/probe_stale_smem.py --runs 100 2>&1 | tail -12
  for i in 1 2 3; do echo "d64 det, try $i: $(timeout 90 $P -k 'd64 and det' 2>&1 | tail -1)"; done
  for i in 1 2 3; do
    echo "seed 802486495 w513 fp16, try $i: $(NCP_TEST_SEED=802486495 timeout 60 $P -k 'auto-equal:513-T2100-8x2-d128-w513-dtype1' 2>&1 | tail -1)"
  done
  timeout 90 python3 benchmarks/diag_bwd_flaky.py 2>&1 | tail -16
} 2>&1 | tee $OUT/repro.txt
# racecheck: the dQ kernel has no mbarrier-ordered generic-proxy hand-off (unlike the dK/dV
# kernel's lse/Delta ring), so any hazard it reports there is worth reading.
timeout 120 compute-sanitizer --tool racecheck --kernel-regex kns=bwd_dq_sm90 \
  $P -k "d64 and det and grid7 and dtype0 and matches_oracle" > $OUT/racecheck_dq.txt 2>&1
echo "racecheck (dQ kernel, D = 64): exit $?; $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' $OUT/racecheck_dq.txt | tail -1)"
NCP_TEST_SEED=802486495 timeout 150 compute-sanitizer --tool memcheck --kernel-regex kns=ncp --error-exitcode 99 \
  $P -k "auto-equal:513-T2100-8x2-d128-w513 or (d64 and det and matches_oracle and grid7)" > $OUT/memcheck_repro.txt 2>&1
echo "memcheck: exit $?; $(grep -E 'ERROR SUMMARY' $OUT/memcheck_repro.txt | tail -1); $(grep -E 'passed|failed' $OUT/memcheck_repro.txt | tail -1)"
