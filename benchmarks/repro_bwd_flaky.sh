#!/usr/bin/env bash
# Repro and check of the flaky CUDA test failures seen at bcdf39e (H100; docs/EXPERIMENTS.md, "Flaky
# CUDA test failures"): D = 64 deterministic dq garbage, dv NaN (the stale-dO read fixed in 9c03d88).
# One device call of about 8 minutes; carry .baseline (an older tree, e.g. 94a6ac7, before the fix):
#   OUT=$OUT NCP_COMMIT=<sha> bash benchmarks/repro_bwd_flaky.sh
# In order (each step under its own timeout, a failing step does not stop the next):
#   1. build (and .baseline beside it), the whole CUDA suite (gpu_run.sh test): summary.txt names
#      the GPU's UUID first (the failures followed machines), pytest.log;
#   2. the stale-shared-memory poison probe on .baseline and on this tree (repro.txt);
#   3. the seed that gave dv NaN, three times; the D = 64 deterministic tests, twice (where they
#      fail, benchmarks/diag_bwd_flaky.py: which rows, heads and tiles of dq go wrong, and
#      racecheck on the D = 64 dQ kernel);
#   4. memcheck on the window-513 and D = 64 deterministic tests (memcheck_repro.txt);
#   5. with AB=1, the waits' cost: gpu_run.sh's ab stage, .baseline against this tree on window 513
#      (ab_attn.json; AB_ARGS to change the cases);
#   6. the sink's cost on causal 8k documents (benchmarks/diag_sink_cost.py, sink_cost.json).
# The most wanted results come first: a call cut short by its time limit keeps them.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES="build test"; [ -d .baseline ] && STAGES="build baseline test"
OUT=$OUT NCP_COMMIT=${NCP_COMMIT:-x} bash benchmarks/gpu_run.sh $STAGES > /dev/null 2>&1; cat $OUT/summary.txt
grep -E "^FAILED" $OUT/pytest.log | head -30
P="python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_sink_attention_cuda.py"
mkdir -p build && nvcc -shared -Xcompiler -fPIC -o build/probe_stale_smem.so benchmarks/probe_stale_smem.cu
{
  if [ -d .baseline ]; then
    echo "== poison probe, .baseline"; (cd .baseline && timeout 80 python3 ../benchmarks/probe_stale_smem.py --runs 100 --lib ../build/probe_stale_smem.so 2>&1 | tail -8)
  fi
  echo "== poison probe, this tree"; timeout 80 python3 benchmarks/probe_stale_smem.py --runs 100 2>&1 | tail -8
  for i in 1 2 3; do
    echo "seed 802486495 w513 fp16, try $i: $(NCP_TEST_SEED=802486495 timeout 40 $P -k 'auto-equal:513-T2100-8x2-d128-w513-dtype1' 2>&1 | tail -1)"
  done
  for i in 1 2; do
    r=$(timeout 60 $P -k 'd64 and det' 2>&1 | tail -1); echo "d64 det, try $i: $r"
    case "$r" in *failed*)
      timeout 90 python3 benchmarks/diag_bwd_flaky.py 2>&1 | tail -16
      # racecheck: the dQ kernel has no mbarrier-ordered generic-proxy hand-off (unlike the dK/dV
      # kernel's lse/Delta ring), so any hazard it reports there is worth reading.
      timeout 120 compute-sanitizer --tool racecheck --kernel-regex kns=bwd_dq_sm90 \
        $P -k "d64 and det and grid7 and dtype0 and matches_oracle" > $OUT/racecheck_dq.txt 2>&1
      echo "racecheck (dQ kernel, D = 64): exit $?; $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' $OUT/racecheck_dq.txt | tail -1)";;
    esac
  done
} 2>&1 | tee $OUT/repro.txt
NCP_TEST_SEED=802486495 timeout 120 compute-sanitizer --tool memcheck --kernel-regex kns=ncp --error-exitcode 99 \
  $P -k "auto-equal:513-T2100-8x2-d128-w513 or (d64 and det and matches_oracle and grid7)" > $OUT/memcheck_repro.txt 2>&1
echo "memcheck: exit $?; $(grep -E 'ERROR SUMMARY' $OUT/memcheck_repro.txt | tail -1); $(grep -E 'passed|failed' $OUT/memcheck_repro.txt | tail -1)"
if [ "${AB:-0}" = 1 ] && [ -d .baseline ]; then
  AB_ARGS=${AB_ARGS:-"--cases flint-2k-w513,flint-8k-w513 --rounds 4"} OUT=$OUT NCP_COMMIT=${NCP_COMMIT:-x} \
    bash benchmarks/gpu_run.sh ab > /dev/null 2>&1; tail -25 $OUT/summary.txt
fi
echo "== sink cost"; timeout 90 python3 benchmarks/diag_sink_cost.py --json $OUT/sink_cost.json 2>&1 | tail -6 | tee -a $OUT/repro.txt
