#!/usr/bin/env bash
# One call on the GPU machine: build, CUDA tests, compute-sanitizer, benchmarks, the demo.
# Logs and JSON go to $OUT (at most 8 files come back: keep it to these):
#   build.log  pytest.log  sanitizer.log  bench_attn.json  bench_mimo.json  bench_flint.json
#   summary.txt (headlines + every benchmark's printed table + the demo's output)  sass.txt
#   (probe.log with probe, ncu.txt with profile)
# Back on the development machine, BENCHMARKS.md and its plot come from the three JSON files:
#   python benchmarks/render_records.py --import $OUT --prune && python benchmarks/plot_attention.py
#
#   OUT=/tmp/out NCP_COMMIT=<sha> bash benchmarks/gpu_run.sh [stage ...]
# Set NCP_COMMIT from the machine that holds the repository: the device tool's copy of .git can be
# stale, so `git rev-parse` run there may name an older commit than the tree it copied.
# stages: build baseline ctaclock test sanitize probe compress profile srcprof kernels sinkpair attn ab abmimo abhost abhint order latency host mimo profmimo flint demo all (default: all; sinkpair: the sink's cost paired by round beside a null row, SINKPAIR_RUNS, SINKPAIR_ARGS; order:
# bench_bwd_order.py, atomic and deterministic, ORDER_ARGS; probe: the
# racecheck mbarrier probe, compress: benchmarks/probe_compress.cu, profile: Nsight Compute on named kernels, PROF_RUNS, PROF_ENV; profmimo:
# benchmarks/profile_mimo.py; latency: benchmarks/probe_latency.py, LATENCY_ARGS; abmimo: benchmarks/ab_mimo.py (.baseline against this tree); abhost:
# benchmarks/ab_host.py (the attention calls' host path, .baseline against this tree); ctaclock:
# benchmarks/probe_cta_clock.py on a probe build of this tree (NCP_CTA_CLOCK=1, in .probe/), CTA_ARGS; abhint:
# benchmarks/ab_table_hint.py;
# neither is part of all; baseline builds the tree in .baseline/ (carry it: an older commit's source,
# e.g. `git archive <sha> csrc nemo_cp_native scripts setup.py pyproject.toml | tar -x -C .baseline`;
# setup.py loads scripts/ptxas_check.py) beside
# the main build, and ab times both builds round robin with benchmarks/ab_attention.py, AB_ARGS;
# neither is part of all). Test, sanitizer,
# attention and demo stages run under `timeout` (TEST_TIMEOUT, SAN_TIMEOUT, ATTN_TIMEOUT, DEMO_TIMEOUT seconds). Each stage appends its
# headline to summary.txt; a failing stage is reported and the next one still runs. racecheck shows every
# hazard (SAN_MAX_HAZARDS, default 100000; the tool's own default shows 100) and summary.txt gets each
# source line that takes part in one, with its count.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ncp_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCP_COMMIT=${NCP_COMMIT:-unknown}
PY=${PY:-python3}
STAGES=${*:-all}
SUM="$OUT/summary.txt"
note() { echo "[$(date +%T)] $*" | tee -a "$SUM"; }
want() { [[ " $STAGES " == *" all "* || " $STAGES " == *" $1 "* ]]; }

note "commit $NCP_COMMIT stages: $STAGES"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,ecc.errors.uncorrected.volatile.total --format=csv,noheader >> "$SUM" 2>&1

if [[ " $STAGES " == *" ctaclock "* ]]; then  # the probe build (NCP_CTA_CLOCK=1) of this tree in .probe/, in the background
  rm -rf .probe && mkdir .probe && cp -r csrc nemo_cp_native scripts benchmarks setup.py pyproject.toml .probe/ \
    && rm -f .probe/nemo_cp_native/_C*.so
  ( cd .probe && NCP_FORCE_CUDA=1 NCP_CTA_CLOCK=1 NCP_NVCC_JOBS=8 $PY setup.py build_ext --inplace \
      > "$OUT/probe_build.log" 2>&1 ) &
  PROBE_PID=$!
fi

if [[ " $STAGES " == *" baseline "* ]]; then  # built in the background, beside the main build
  ( cd .baseline && rm -f nemo_cp_native/_C*.so && NCP_FORCE_CUDA=1 NCP_NVCC_JOBS=8 $PY setup.py build_ext --inplace \
      > "$OUT/baseline_build.log" 2>&1 ) &
  BASELINE_PID=$!
fi

if want build || [ ! -e nemo_cp_native/_C*.so ] || ! ls nemo_cp_native/_C*cpython-3*.so >/dev/null 2>&1; then
  rm -f nemo_cp_native/_C*.so
  if ! NCP_FORCE_CUDA=1 NCP_PTXAS_VERBOSE=1 NCP_NVCC_JOBS=16 $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
     || ! $PY -c "import nemo_cp_native as n; assert n.has_cuda()" >> "$OUT/build.log" 2>&1; then
    note "build with cached CUDA objects failed; rebuilding from source"
    rm -rf build/ncp_cuda nemo_cp_native/_C*.so
    NCP_FORCE_CUDA=1 NCP_PTXAS_VERBOSE=1 NCP_NVCC_JOBS=16 $PY setup.py build_ext --inplace >> "$OUT/build.log" 2>&1 \
      || { note "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
  fi
  cat build/ncp_ptxas/*.txt >> "$OUT/build.log" 2>/dev/null
  note "build ok: $($PY -c 'import nemo_cp_native as n, json; print(json.dumps(n.build_info()))')"
  so=$(ls nemo_cp_native/_C*.so | head -1)
  { echo "== HMMA/HGMMA counts per kernel (cuobjdump --dump-sass $so)";
    cuobjdump --dump-sass "$so" | awk '/Function :/{f=$3} /HGMMA/{g[f]++} /HMMA/{h[f]++} END{for(k in h) print "HMMA", h[k], k; for(k in g) print "HGMMA", g[k], k}';
    echo "== local memory (LDL/STL) per kernel";
    cuobjdump --dump-sass "$so" | awk '/Function :/{f=$3} /LDL|STL/{l[f]++} END{for(k in l) print l[k], k}'; } > "$OUT/sass.txt" 2>&1
fi

if [[ " $STAGES " == *" baseline "* ]]; then
  wait $BASELINE_PID && note "baseline build ok" || { note "BASELINE BUILD FAILED"; tail -30 "$OUT/baseline_build.log"; }
  cat "$OUT/baseline_build.log" >> "$OUT/build.log"; rm -f "$OUT/baseline_build.log"
fi

if want test; then
  timeout ${TEST_TIMEOUT:-420} $PY -m pytest -q -p no:cacheprovider -m cuda tests/ -rs --continue-on-collection-errors ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  note "cuda tests: $(tail -1 "$OUT/pytest.log")"
fi

if want sanitize; then
  : > "$OUT/sanitizer.log"
  for tool in ${SAN_TOOLS:-memcheck racecheck synccheck initcheck}; do
    start=$(wc -l < "$OUT/sanitizer.log")
    # racecheck displays its first 100 hazards unless told otherwise: show them all (SAN_MAX_HAZARDS)
    NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=${SAN_MAX_HAZARDS:-100000} \
      timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool $tool --kernel-regex kns=ncp --error-exitcode 99 $PY benchmarks/sanitize_kernels.py ${SAN_PARTS:-} \
      >> "$OUT/sanitizer.log" 2>&1
    note "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer.log") clean summaries so far)"
    if [ "$tool" = racecheck ]; then  # each source line that takes part in a hazard, with its count
      tail -n +$((start + 1)) "$OUT/sanitizer.log" | grep -E 'Race reported|and (Read|Write) access' \
        | grep -oE 'in [A-Za-z0-9_]+\.cuh?:[0-9]+' | sort | uniq -c | sort -rn | tee -a "$SUM"
    fi
    if [ "$tool" = memcheck ]; then  # the THD/MiMo/attention kernels on malformed inputs (issue 17)
      timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool memcheck --kernel-regex kns=ncp --error-exitcode 99 \
        $PY tests/gpu_malformed_inputs.py >> "$OUT/sanitizer.log" 2>&1
      note "compute-sanitizer memcheck, tests/gpu_malformed_inputs.py: exit $?"
    fi
  done
fi

if [[ " $STAGES " == *" probe "* ]]; then  # only when named: does racecheck model mbarrier hand-offs? (BENCHMARKS.md, known limits)
  mkdir -p build
  if nvcc -arch=sm_90a -o build/racecheck_mbarrier_probe benchmarks/racecheck_mbarrier_probe.cu > "$OUT/probe.log" 2>&1; then
    timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool racecheck build/racecheck_mbarrier_probe >> "$OUT/probe.log" 2>&1
    note "racecheck probe: exit $? ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/probe.log" | tail -1))"
  else
    note "racecheck probe: nvcc failed (probe.log)"
  fi
fi

if [[ " $STAGES " == *" compress "* ]]; then  # only when named: compressible memory for the dQ accumulator? (docs/EXPERIMENTS.md)
  mkdir -p build
  if nvcc -arch=sm_90a -O2 -o build/probe_compress benchmarks/probe_compress.cu -lcuda > "$OUT/probe_compress.txt" 2>&1; then
    build/probe_compress >> "$OUT/probe_compress.txt" 2>&1
    note "compress probe: exit $? ($(grep -c adds= "$OUT/probe_compress.txt") timed rows)"
  else
    note "compress probe: nvcc failed (probe_compress.txt)"
  fi
fi

if [[ " $STAGES " == *" profile "* ]]; then  # only when named: Nsight Compute, the 4th launch of each kernel (ncu.txt)
  # PROF_RUNS: case:kernel-regex[:bwd] items; the kernel regex names one kernel of the call
  details=""; ncu --help 2>/dev/null | grep -q -- "--print-details" && details="--print-details all"
  for item in ${PROF_RUNS:-flint-8k-causal:sink_attn_fwd_sm90 flint-8k-w513:sink_attn_fwd_sm90 flint-8k-causal:bwd_dkdv_sm90:bwd flint-8k-w513:bwd_dkdv_sm90:bwd}; do
    IFS=: read -r c k b <<< "$item"
    echo "==== $c $k (${PROF_ENV:-defaults})" >> "$OUT/ncu.txt"
    env ${PROF_ENV:-} timeout ${PROF_TIMEOUT:-200} ncu --clock-control none --kernel-name regex:$k --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy $details \
      $PY benchmarks/profile_attn.py ${b:+--bwd} $c >> "$OUT/ncu.txt" 2>&1
    note "ncu $c $k: exit $?"
  done
fi

if [[ " $STAGES " == *" srcprof "* ]]; then  # only when named: Nsight Compute stall sampling per SASS instruction (srcprof.tar.gz)
  # SRCPROF_RUNS like PROF_RUNS; per item a text summary (srcprof.txt) and the SASS page as CSV (in srcprof.tar.gz)
  mkdir -p /tmp/srcprof
  for item in ${SRCPROF_RUNS:-flint-8k-causal:sink_attn_fwd_sm90 flint-8k-w513:sink_attn_fwd_sm90}; do
    IFS=: read -r c k b <<< "$item"
    tag="${c}_${k}${b:+_bwd}"
    echo "==== $c $k (${PROF_ENV:-defaults})" >> "$OUT/srcprof.txt"
    env ${PROF_ENV:-} timeout ${PROF_TIMEOUT:-200} ncu --clock-control none --kernel-name regex:$k --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --import-source no -f -o /tmp/srcprof/$tag \
      $PY benchmarks/profile_attn.py ${b:+--bwd} $c >> "$OUT/srcprof.txt" 2>&1
    note "ncu srcprof $c $k: exit $?"
    ncu -i /tmp/srcprof/$tag.ncu-rep --print-details all >> "$OUT/srcprof.txt" 2>&1
    ncu -i /tmp/srcprof/$tag.ncu-rep --page source --csv --print-source sass > /tmp/srcprof/$tag.csv 2>> "$OUT/srcprof.txt" \
      || ncu -i /tmp/srcprof/$tag.ncu-rep --page source --csv > /tmp/srcprof/$tag.csv 2>> "$OUT/srcprof.txt"
    note "sass page $tag: $(wc -l < /tmp/srcprof/$tag.csv) lines"
  done
  tar -C /tmp/srcprof -czf "$OUT/srcprof.tar.gz" --exclude='*.ncu-rep' .
fi

if [[ " $STAGES " == *" ctaclock "* ]]; then  # only when named: per-CTA timeline of the dK/dV kernel, CTA_ARGS
  if wait $PROBE_PID; then
    note "probe build ok"
    $PY .probe/benchmarks/probe_cta_clock.py ${CTA_ARGS:-} --json "$OUT/cta_clock.json" >> "$SUM" 2>&1
    note "probe_cta_clock exit $?"
  else
    note "PROBE BUILD FAILED"; tail -30 "$OUT/probe_build.log" >> "$SUM"
  fi
  rm -f "$OUT/probe_build.log"
fi

if want kernels; then
  $PY benchmarks/bench_kernels.py --json "$OUT/bench_kernels.json" >> "$SUM" 2>&1
  note "bench_kernels exit $?"
fi

if [[ " $STAGES " == *" sinkpair "* ]]; then  # only when named: the sink's cost, paired by round, beside a null row
  # ncp, ncp-nosink and ncp-null (ncp again, under a switch nothing reads): the null row's paired
  # ratio to ncp is the method's own floor for a difference between two rows. SINKPAIR_RUNS runs.
  for r in $(seq 1 ${SINKPAIR_RUNS:-2}); do
    timeout ${ATTN_TIMEOUT:-500} $PY benchmarks/bench_sink_attention.py --impls ncp,ncp-nosink \
      --variant ncp-null:NCP_BENCH_NULL_ROW=1 --method do_bench --no-flex \
      ${SINKPAIR_ARGS:---cases flint-8k-causal,flint-32k-causal,flint-2k-w513 --reps 40} \
      --json "$OUT/sink_pair_$r.json" >> "$SUM" 2>&1
    note "sink pair run $r: exit $?"
  done
  timeout 120 $PY benchmarks/probe_sdpa_kernels.py >> "$SUM" 2>&1
  note "probe_sdpa_kernels exit $?"
fi

if want attn; then
  timeout ${ATTN_TIMEOUT:-500} $PY benchmarks/bench_sink_attention.py ${ATTN_ARGS:-} --json "$OUT/bench_attn.json" >> "$SUM" 2>&1
  note "bench_sink_attention exit $?"
fi

if [[ " $STAGES " == *" ab "* ]]; then
  timeout ${AB_TIMEOUT:-500} $PY benchmarks/ab_attention.py --a .baseline --b . ${AB_ARGS:-} --json "$OUT/ab_attn.json" >> "$SUM" 2>&1
  note "ab_attention (A = .baseline, B = this tree) exit $?"
fi

if [[ " $STAGES " == *" abmimo "* ]]; then  # only when named: the MiMo sharder, .baseline against this tree
  timeout ${AB_TIMEOUT:-500} $PY benchmarks/ab_mimo.py --a .baseline --b . --json "$OUT/ab_mimo.json" >> "$SUM" 2>&1
  note "ab_mimo (A = .baseline, B = this tree) exit $?"
fi

if [[ " $STAGES " == *" abhost "* ]]; then  # only when named: the attention calls' host path, .baseline against this tree
  timeout ${AB_TIMEOUT:-500} $PY benchmarks/ab_host.py --a .baseline --b . --json "$OUT/ab_host.json" >> "$SUM" 2>&1
  note "ab_host (A = .baseline, B = this tree) exit $?"
fi

if [[ " $STAGES " == *" abhint "* ]]; then  # only when named: Flint CP tables with and without the window hint
  timeout ${AB_TIMEOUT:-500} $PY benchmarks/ab_table_hint.py --json "$OUT/ab_hint.json" >> "$SUM" 2>&1
  note "ab_table_hint exit $?"
fi

if [[ " $STAGES " == *" order "* ]]; then  # only when named: the backward's tile orders (bench_bwd_order.py)
  $PY benchmarks/bench_bwd_order.py ${ORDER_ARGS:-} --json "$OUT/bench_order.json" >> "$SUM" 2>&1
  note "bench_bwd_order exit $?"
  $PY benchmarks/bench_bwd_order.py --det ${ORDER_ARGS:-} --json "$OUT/bench_order_det.json" >> "$SUM" 2>&1
  note "bench_bwd_order --det exit $?"
fi

if [[ " $STAGES " == *" latency "* ]]; then  # only when named: the do_bench forward's host latency (probe_latency.py)
  timeout ${AB_TIMEOUT:-500} $PY benchmarks/probe_latency.py ${LATENCY_ARGS:-} --json "$OUT/probe_latency.json" >> "$SUM" 2>&1
  note "probe_latency exit $?"
fi

if want host; then
  $PY benchmarks/bench_host.py --json "$OUT/bench_host.json" >> "$SUM" 2>&1
  note "bench_host exit $?"
fi

if want mimo; then
  $PY benchmarks/bench_mimo_shard.py --device cuda ${MIMO_ARGS:-} --json "$OUT/bench_mimo.json" >> "$SUM" 2>&1
  note "bench_mimo_shard exit $?"
fi

if [[ " $STAGES " == *" profmimo "* ]]; then  # only when named: where the MiMo call's wall time goes
  $PY benchmarks/profile_mimo.py >> "$SUM" 2>&1
  note "profile_mimo exit $?"
  $PY benchmarks/profile_mimo.py --meta gpu >> "$SUM" 2>&1
  note "profile_mimo --meta gpu exit $?"
fi

if want flint; then
  $PY benchmarks/bench_flint.py ${FLINT_ARGS:-} --json "$OUT/bench_flint.json" >> "$SUM" 2>&1
  note "bench_flint exit $?"
fi
if want demo; then  # the README's main job: parity checks, then ours against Flex+sink, SDPA and the torch ops
  timeout ${DEMO_TIMEOUT:-240} $PY -m nemo_cp_native demo ${DEMO_ARGS:-} >> "$SUM" 2>&1
  note "demo exit $?"
fi
note "done"
