"""Renders the tables of BENCHMARKS.md (figures of record) and docs/EXPERIMENTS.md (design choices
measured: A/B runs, tile orders, what was tried and lost) from the raw JSON files of the
benchmarks, so that every figure on the pages is copied by the machine, never by hand.

Each page holds generated blocks between marker comments that name their kind and sources:

    <!-- BEGIN GENERATED attn benchmarks/results/2026-12-03_27498c3_attn.json -->
    ...
    <!-- END GENERATED attn -->

kinds: ``attn`` (every case: ours against FlexAttention+sink and SDPA), ``attn-extra`` (our other
rows: no sink, deterministic backward, A/B variants), ``mimo`` (one or more runs of
bench_mimo_shard.py), ``flint`` (one or more runs of bench_flint.py), ``host`` (bench_host.py),
``order`` (bench_bwd_order.py), ``ab`` (ab_attention.py), ``ab-bwd`` (ab_attention.py, the backward
alone, paired by round), ``ab-mimo`` (ab_mimo.py), ``ab-hint``
(ab_table_hint.py), ``ab-host`` (ab_host.py), ``sink-pair`` (gpu_run.sh sinkpair: the sink's cost
and a null row, paired by round), ``tried`` (the losers, from the files that record them).

    # after a GPU run of benchmarks/gpu_run.sh: copy its JSON into benchmarks/results/ and re-render
    python benchmarks/render_records.py --import $OUT [--prune]
    # re-render from the sources the blocks name (or from other files: --attn/--mimo/--flint PATH)
    python benchmarks/render_records.py
    # check that the page matches its sources (tests/test_records.py runs this)
    python benchmarks/render_records.py --check

``--import DIR`` takes ``bench_{attn,mimo,flint,host,order,order_det}.json`` from DIR,
stores them as ``benchmarks/results/<date>_<commit>_<kind>.json``, points the ``attn`` and
``attn-extra`` blocks at the new attention file, and replaces the ``mimo``/``flint`` source of the
same machine kind (GPU or CPU). ``--prune`` deletes the files under benchmarks/results/ that no
page cites any more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "BENCHMARKS.md")  # the figures of record: one page
EXPERIMENTS = os.path.join(ROOT, "docs", "EXPERIMENTS.md")  # design choices measured: A/B runs, losers
RESULTS = "benchmarks/results"
BLOCK = re.compile(r"<!-- BEGIN GENERATED (\S+)((?: \S+)*) -->\n.*?<!-- END GENERATED \1 -->", re.S)
BASELINES = ("ncp", "flex+sink", "sdpa(no sink)")
LABELS = {"ncp": "ours", "flex+sink": "FlexAttention+sink", "sdpa(no sink)": "SDPA (no sink)",
          "ncp-nosink": "ours, no sink", "ncp-deterministic": "ours, deterministic bwd"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _read(path: str) -> dict:
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def load_attn(path: str) -> dict:
    """A bench_sink_attention.py JSON, normalized: methods (first = primary), cases in order with
    their shapes, implementations in order, and t[(case, impl, method)] = dict(fwd, fb, fwd_ms,
    fb_ms) in TFLOP/s and ms, or None for a row that failed."""
    data = _read(path)
    env, rows = data["env"], data["rows"]
    legacy = "methods" not in env  # files written before the do_bench/queued split
    if legacy:
        methods = ["queued"] if any("queued" in (r.get("note") or "") for r in rows) else ["idle"]
    else:
        methods = list(env["methods"])
    cases, impls, shape, t = [], [], {}, {}
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
        if r["impl"] not in impls:
            impls.append(r["impl"])
        if "tokens" in r:
            shape[r["case"]] = (r["tokens"], r["doc"], r["heads"], r["D"], r["window"])
        for m in methods:
            sfx = "" if legacy else {"queued": "_queued", "loop": "_loop"}.get(m, "")
            ok = r.get("fwd_tflops" + sfx) is not None
            t[r["case"], r["impl"], m] = dict(fwd=r["fwd_tflops" + sfx], fb=r.get("fwdbwd_tflops" + sfx),
                                              fwd_ms=r["fwd_ms" + sfx], fb_ms=r.get("fwdbwd_ms" + sfx)) if ok else None  # fmt: skip
    return dict(path=path, env=env, legacy=legacy, methods=methods, cases=cases, impls=impls, shape=shape, t=t)


def method_text(a: dict, m: str) -> str:
    if m == "do_bench":
        return ("**do_bench**: each call as a user makes it (default arguments), on an idle GPU, L2 flushed "
                "before every call, CUDA events, median")  # fmt: skip
    if m == "loop":
        return ("**loop**: the same calls in triton's `do_bench` loop (L2 flushed before every call, CUDA events, "
                "one host wait after the last of 5 calls, median): the host runs ahead as in a training loop")  # fmt: skip
    if m == "queued":
        text = ("**queued**: a GPU spin queued before every call and `validate=False`, so the host launches "
                "while the GPU is busy and the events time the GPU work; CUDA events, median")  # fmt: skip
        return text + ("; this run did not flush L2" if a["legacy"] else ", L2 flushed")
    return "**idle**: CUDA events on an idle GPU, `validate=False`, no L2 flush, median"


def _when(env: dict) -> str:
    return env["date"].replace("T", " ")[:16] + " UTC"


def _command(env: dict) -> str:
    argv = re.sub(r" --json \S+", "", env.get("argv", ""))
    return f"`python {argv}`" if argv else "(command not recorded)"


def machine(env: dict, gpu: bool) -> str:
    if gpu and env.get("gpu"):
        return env["gpu"]
    cores = f", {env['host_cpus']} cores" if env.get("host_cpus") else ""
    return f"{env.get('cpu', 'CPU')} CPU{cores}" + (f" (host of {env['gpu']})" if env.get("gpu") else "")


def source_line(path: str, env: dict, gpu: bool = True) -> str:
    cuda = f", CUDA {env['cuda']}" if gpu and env.get("cuda") else ""
    return (f"Source: `{path}`: {machine(env, gpu)}, torch {env['torch']}{cuda}, Python {env.get('python', '?')}, "
            f"commit `{env['commit']}`, {_when(env)}; {_command(env)}.")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def _pair(x) -> str:
    return "failed" if x is None else f"{x['fwd']} / {x['fb']}"


def _ratio(a, b) -> str:
    if a is None or b is None:
        return "–"
    return f"{a['fwd'] / b['fwd']:.2f}x / {a['fb'] / b['fb']:.2f}x"


def _shape(a: dict, case: str) -> str:
    if case not in a["shape"]:
        return ""
    tokens, doc, heads, d, window = a["shape"][case]
    return f"{tokens // 1024}k, {doc // 1024}k docs, {heads}/{d}, " + (f"w{window}" if window else "causal")


def render_attn(paths: list[str]) -> str:
    a = load_attn(paths[0])
    head, rule = ["case", "tokens, docs, Hq/Hkv/D, mask"], ["---", "---"]
    for i, m in enumerate(a["methods"]):
        tag = "" if i == 0 else f", {m}"
        head += [LABELS[n] + tag for n in BASELINES] + [f"ours / Flex{tag}"]
        rule += ["---:"] * (len(BASELINES) + 1)
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for c in a["cases"]:
        cells = [c, _shape(a, c)]
        for m in a["methods"]:
            got = {n: a["t"].get((c, n, m), "n/a") for n in BASELINES}
            cells += ["–" if got[n] == "n/a" else _pair(got[n]) for n in BASELINES]
            flex = got["flex+sink"]
            cells.append(_ratio(got["ncp"], None if flex == "n/a" else flex))
        out.append("| " + " | ".join(cells) + " |")
    primary = a["methods"][0]
    out.append("")
    which = "Columns without a suffix" if len(a["methods"]) > 1 else "Timing"
    out.append(f"TFLOP/s, forward / forward+backward (bf16). {which}: {method_text(a, primary)}.")
    for m in a["methods"][1:]:
        out.append(f"Columns marked *{m}*: {method_text(a, m)}.")
    if "do_bench" not in a["methods"]:
        out.append("This run predates the do_bench timing, which `bench_sink_attention.py` now records by default "
                   "beside the queued one.")  # fmt: skip
    out.append(source_line(a["path"], a["env"]))
    return "\n".join(out)


def render_attn_extra(paths: list[str]) -> str:
    a = load_attn(paths[0])
    m = a["methods"][0]
    others = [n for n in a["impls"] if n not in BASELINES]
    head = ["case", "ours"] + [LABELS.get(n, n) for n in others]
    if "ncp-nosink" in others:
        head.append("sink cost, fwd / fwd+bwd time")
    if "ncp-deterministic" in others:
        head.append("deterministic cost, fwd+bwd time")
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for c in a["cases"]:
        ours = a["t"].get((c, "ncp", m))
        row = [c, _pair(ours)] + [_pair(a["t"].get((c, n, m))) for n in others]
        nosink, det = a["t"].get((c, "ncp-nosink", m)), a["t"].get((c, "ncp-deterministic", m))
        if "ncp-nosink" in others:
            row.append("–" if not (ours and nosink) else
                       f"{100 * (ours['fwd_ms'] / nosink['fwd_ms'] - 1):+.1f}% / {100 * (ours['fb_ms'] / nosink['fb_ms'] - 1):+.1f}%")  # fmt: skip
        if "ncp-deterministic" in others:
            row.append("–" if not (ours and det) else f"{100 * (det['fb_ms'] / ours['fb_ms'] - 1):+.1f}%")
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    out.append(f"TFLOP/s, forward / forward+backward, {m} timing, same run as the table above; costs are "
               "time against the row they modify. " + source_line(a["path"], a["env"]))  # fmt: skip
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# MiMo sharder, Flint plans
# ---------------------------------------------------------------------------------------------


def _ms(row, syncs=True) -> str:
    if row is None:
        return "–"
    s = row.get("syncs")
    return f"{row['ms']:.3f}" + (f" ({s} sync{'s' if s != 1 else ''})" if syncs and s is not None else "")


def render_mimo(paths: list[str]) -> str:
    head = ["machine", "case", "native ms", "native, `seq_lens` on CPU", "torch ops + native TE partition",
            "native speedup over it (`seq_lens` on GPU / CPU)", "torch ops + Python TE oracle", "fused gather pass alone",
            "host µs, `seq_lens` on CPU: one call / stream"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    sources, any_gpu, any_idle = [], False, False
    for path in paths:
        data = _read(path)
        gpu = data.get("device") == "cuda"
        cases = []
        for r in data["rows"]:
            if r["case"] not in cases:
                cases.append(r["case"])
        by = {(r["case"], r["impl"]): r for r in data["rows"]}
        for c in cases:
            nat, fast = by.get((c, "native")), by.get((c, "ref(fastTE)"))
            meta = by.get((c, "native(metaCPU)"))
            ratio = f"{fast['ms'] / nat['ms']:.1f}x" if nat and fast else "–"
            if meta and fast:
                ratio += f" / {fast['ms'] / meta['ms']:.1f}x"
            if nat and meta and fast and "ms_idle" in fast:  # runs that also time from an idle GPU
                ratio += (f" (idle GPU: {fast['ms_idle'] / nat['ms_idle']:.1f}x / "
                          f"{fast['ms_idle'] / meta['ms_idle']:.1f}x)")  # fmt: skip
            if meta and "paired" in meta:  # runs since 2026-12-04 18:00: alternating rounds
                pr = meta["paired"]
                ratio += (f"; alternating rounds (`seq_lens` on CPU): {pr['x_fastTE_min']}x-{pr['x_fastTE_max']}x, "
                          f"median {pr['x_fastTE_median']:g}x, host loop "
                          f"{min(x['py_loop_us'] for x in pr['rounds'])}-{max(x['py_loop_us'] for x in pr['rounds'])} µs")  # fmt: skip
            any_idle = any_idle or "ms_idle" in (fast or {})
            pass_ = f"{nat['pass_ms']} ms, {nat['pass_GB/s']} GB/s" if nat and "pass_ms" in nat else "–"
            host = (f"{meta['host_us']} / {meta['host_us_stream']}" if meta and "host_us_stream" in meta
                    else f"{meta['host_us']} / –" if meta else "–")  # fmt: skip
            out.append("| " + " | ".join([machine(data["env"], gpu), c, _ms(nat), _ms(meta), _ms(fast), ratio,
                                          _ms(by.get((c, "ref(pyTE)"))), pass_, host]) + " |")  # fmt: skip
        sources.append(source_line(path, data["env"], gpu))
        any_gpu = any_gpu or gpu
    out.append("")
    out.append("Wall-clock ms per call, median (on a GPU, with a device sync after each call); host syncs per "
               "call in parentheses. Case: B rows of S tokens, C pipeline chunks, cp size, rank.")  # fmt: skip
    if any_idle:
        out.append("GPU rows with an \"idle GPU\" figure time with the GPU's clocks up (a 50 ms spin before the "
                   "repetitions, as in a training loop); in parentheses the same from an idle GPU, the only method "
                   "of the rows without it.")  # fmt: skip
    out += sources
    if not any_gpu:
        out.append("No GPU run of this benchmark is recorded yet (`gpu_run.sh mimo`, then `--import`).")
    return "\n".join(out)


def _flint_plan_rows(runs) -> list[str]:
    out = []
    for path, data in runs:
        for r in data["plan"]:
            if "plan_us" in r:  # bench_flint.py since the linear plan: one rank, windows 0 and 513
                out.append(f"| {machine(data['env'], False)} | {r['case']} | {r['cp']} | {r['plan_us']} | "
                           f"{r['py_partition_only_us']} | {r['peak_MB_beyond_import'] or '–'} |")  # fmt: skip
            else:  # older runs
                out.append(f"| {machine(data['env'], False)} | {r['T']} {r['docs']} | {r['cp']} | {r['c_plan_us']} | "
                           f"{r['py_solver_us']} | |")  # fmt: skip
    return out


def _flint_cp_rows(data) -> list[str]:
    out = ["", "CP attention on one GPU (Flint 32/4/128, every rank simulated): the whole sequence in contiguous "
           "mode against every rank's table-mask kernels, the rank step beyond the kernels, and all ranks with the "
           "exchange routed in-process. TFLOP/s forward / forward+backward:", "",
           "| tokens | cp | doc | window | whole seq | rank kernels (mean) | rank/whole | step / kernels (max) | "
           "all-ranks efficiency |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in data["cp"]:
        out.append(f"| {r['T']} | {r['cp']} | {r['doc']} | {r['window'] or 'causal'} | "
                   f"{r['whole_fwd_tflops']} / {r['whole_fwdbwd_tflops']} | "
                   f"{r['rank_fwd_tflops_mean']} / {r['rank_fwdbwd_tflops_mean']} | "
                   f"{r['rank_over_whole_fwd']} / {r['rank_over_whole_fwdbwd']} | "
                   f"{r['step_over_kernels_fwd_max']} / {r['step_over_kernels_fwdbwd_max']} | "
                   f"{r['all_ranks_efficiency_fwd']} / {r['all_ranks_efficiency_fwdbwd']} |")  # fmt: skip
    return out


def render_flint(paths: list[str]) -> str:
    out = ["Plan build of one rank (windows 0 and 513; peak memory of the C build and its arrays):", "",
           "| machine | pack | cp | plan µs | Python partition alone µs | peak MB |",
           "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    runs = [(p, _read(p)) for p in paths]
    out += _flint_plan_rows(runs)
    out += ["", "K/V each rank receives per layer (bf16 K and V, Hkv = 4, D = 128), against an all-gather:", "",
            "| tokens | cp | documents | window | max rank MB | fraction of an all-gather |", "|---:|---:|---|---:|---:|---:|"]
    for r in runs[-1][1]["volume"]:
        out.append(f"| {r['T']} | {r['cp']} | {r['docs']} | {r['window'] or 'causal'} | {r['max_recv_MB']} | "
                   f"{r['fraction_of_allgather']} |")  # fmt: skip
    gpu = [(p, d) for p, d in runs if d.get("cp")]
    if gpu:
        out += _flint_cp_rows(gpu[-1][1])
    out.append("")
    out += [source_line(p, d["env"], bool(d.get("cp"))) for p, d in runs]
    if not gpu:
        out.append("CP attention needs a GPU; no GPU run of this benchmark is recorded yet (`gpu_run.sh flint`, "
                   "then `--import`).")  # fmt: skip
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Tried and lost: alternatives measured against the default of their day, in the same run
# ---------------------------------------------------------------------------------------------

_R = "benchmarks/results/2026-12-0"
# (what, how it was selected, metric, [(file, row, the row it is compared with)])
TRIED = [
    ("Serial forward schedule", "`NCP_SM90_FWD_SCHED=serial`", "fwd",
     [(_R + "2_2972be1_attn.json", "ncp-fwd-serial", "ncp-fwd-pingpong")]),
    ("3-stage K/V ring", "`NCP_SM90_FWD_STAGES=3`", "fwd",
     [(_R + "2_2972be1_attn.json", "ncp-fwd-3stages", "ncp-fwd-pingpong")]),
    ("One CTA per work item instead of a persistent grid", "`NCP_SM90_FWD_PERSIST=0`", "fwd",
     [(_R + "2_2972be1_attn.json", "ncp-fwd-per-item", "ncp-fwd-persistent"),
      (_R + "2_768e886_attn_6cases.json", "ncp-fwd-per-item", "ncp")]),
    ("Scores scaled before the softmax (scale not folded into the exponent)", "`NCP_SM90_FWD_FOLD=0`", "fwd",
     [(_R + "2_3ac3d1e_attn_ab.json", "ncp-fwd-nofold", "ncp"),
      (_R + "2_2972be1_attn.json", "ncp-fwd-nofold", "ncp-fwd-pingpong")]),
    ("O copied out by the consumer threads (no TMA store)", "`NCP_SM90_FWD_OSTORE=0`", "fwd",
     [(_R + "2_3ac3d1e_attn_ab.json", "ncp-fwd-thread-store", "ncp"),
      (_R + "2_fb7bcfc_attn_ab.json", "ncp-fwd-thread-store", "ncp")]),
    ("O's TMA store issued only when its Q buffer is needed again", "`NCP_SM90_FWD_EAGER_STORE=0`", "fwd",
     [(_R + "2_fb7bcfc_attn_ab.json", "ncp-fwd-late-store", "ncp")]),
    ("O rescaled on every tile (not only where a row maximum changed)", "`NCP_SM90_FWD_LAZY=0`", "fwd",
     [(_R + "2_3ac3d1e_attn_ab.json", "ncp-fwd-eager-rescale", "ncp"),
      (_R + "2_2972be1_attn.json", "ncp-fwd-eager-rescale", "ncp-fwd-pingpong")]),
    ("Whole edge tiles (no 64-key half tiles)", "`NCP_SM90_FWD_HALF=0`", "fwd",
     [(_R + "3_27498c3_attn_early_queued.json", "ncp-fwd-nohalf", "ncp"),
      (_R + "3_8ee708e_attn_half.json", "ncp-fwd-nohalf", "ncp")]),
    ("Next item's first S issued with the last P V when its loads are in", "`NCP_SM90_FWD_EARLY=1`", "fwd",
     [(_R + "3_27498c3_attn_early_queued.json", "ncp-fwd-early", "ncp")]),
    ("Next item's first S issued during the epilogue, unconditionally", "removed", "fwd",
     [(_R + "2_3ac3d1e_attn_ab.json", "ncp-fwd-early", "ncp")]),
    ("An item's last P V carried into the next item's first turn", "removed", "fwd",
     [(_R + "2_0e3a5b5_attn_ab.json", "ncp", "ncp-fwd-nocarry")]),
    ("Softmax/MMA overlap inside a warpgroup (forward)", "`NCP_SM90_FWD_OVERLAP=1`, removed", "fwd",
     [(_R + "2_9b195b0_attn.json", "ncp-sm90-overlap", "ncp")]),
    ("Atomic dQ by per-thread reductions instead of bulk reductions", "`NCP_SM90_DQ=red`", "fb",
     [(_R + "2_2972be1_attn.json", "ncp-sm90-dq-red", "ncp-fwd-pingpong")]),
    ("Deterministic dK/dV with MMA overlap", "`NCP_SM90_BWD_OVERLAP=1`", "fb",
     [(_R + "2_2972be1_attn.json", "ncp-sm90-bwd-overlap", "ncp-deterministic")]),
]  # fmt: skip


def _short(path: str) -> str:
    return path.split("_")[1]  # the commit


def render_tried(paths: list[str]) -> str:
    """One line per alternative: the change of its TFLOP/s against the row it was compared with,
    over every case of its runs, and every case where it was faster."""
    out = []
    for what, how, metric, runs in TRIED:
        changes = []  # (percent, case, commit)
        for path, row, base in runs:
            a = load_attn(path)
            m = a["methods"][0]
            for c in a["cases"]:
                x, y = a["t"].get((c, row, m)), a["t"].get((c, base, m))
                if x and y:
                    changes.append((100 * (x[metric] / y[metric] - 1), c, _short(path)))
        lo, hi = min(changes), max(changes)
        commits = ", ".join(f"`{_short(p)}`" for p, _, _ in runs)
        line = (f"- {what}, {how}: {'forward' if metric == 'fwd' else 'forward+backward'} {lo[0]:+.1f}% ({lo[1]}) "
                f"to {hi[0]:+.1f}% ({hi[1]}); {len(changes)} cases, run{'s' if len(runs) > 1 else ''} {commits}")  # fmt: skip
        wins = [f"{c} ({p:+.1f}%, `{k}`)" for p, c, k in changes if p > 1.0]
        out.append(line + (f"; faster on {', '.join(wins)}" if wins else "") + ".")
    return "\n".join(out)


def tried_sources() -> list[str]:
    return sorted({p for *_, runs in TRIED for p, _, _ in runs})


def _ab_rows(runs: list[dict], cell_pair) -> list[str]:
    """Table rows of A/B runs (ab_attention.py): one row per case (in first-seen order), two cells
    per run from ``cell_pair(row)``, dashes where a run lacks the case."""
    cases: list[str] = []
    for data in runs:
        cases += [r["case"] for r in data["rows"] if r["case"] not in cases]
    out = []
    for c in cases:
        cells = [c]
        for data in runs:
            r = next((r for r in data["rows"] if r["case"] == c), None)
            cells += ["–", "–"] if r is None else cell_pair(r)
        out.append("| " + " | ".join(cells) + " |")
    return out


def render_ab(paths: list[str]) -> str:
    """benchmarks/ab_attention.py: two builds timed round robin in one process; one column pair per
    file (a file named ``*_det.json`` was run with ``NCP_DETERMINISTIC=1``), cases in rows."""
    runs = [_read(p) for p in paths]
    modes = ["deterministic" if p.endswith("_det.json") else "atomic dQ" for p in paths]
    first = runs[0]
    out = [f"A = `{first['a']}`, B = `{first['b']}`; {first['method']}. TFLOP/s forward / forward+backward, "
           "B / A in parentheses:", "",
           "| case | " + " | ".join(f"{m}: A | {m}: B" for m in modes) + " |",
           "|---|" + "---:|---:|" * len(runs)]  # fmt: skip
    out += _ab_rows(runs, lambda r: [f"{r['a']['fwd_tflops']} / {r['a']['fwdbwd_tflops']}",
                                     f"{r['b']['fwd_tflops']} / {r['b']['fwdbwd_tflops']} "
                                     f"({r['b_over_a_fwd']} / {r['b_over_a_fwdbwd']})"])
    out += [""] + [f"Source: `{p}`." for p in paths]
    return "\n".join(out)


def render_ab_bwd(paths: list[str]) -> str:
    """benchmarks/ab_attention.py, the backward alone: per round, forward+backward time minus forward
    time of each build; the median over rounds of each, and of B / A paired by round (the rounds
    run A and B back to back, so pairing removes most of the clock drift between rounds)."""
    runs = [_read(p) for p in paths]
    first = runs[0]
    out = [f"A = `{first['a']}`, B = `{first['b']}`; backward ms per round = forward+backward - forward "
           "(same round); median A / median B, then the median of the per-round B / A and the rounds in "
           "which B was faster:", "",
           "| case | " + " | ".join(f"run {i + 1}: bwd ms A / B | run {i + 1}: B / A (B faster)" for i in range(len(runs))) + " |",
           "|---|" + "---:|---:|" * len(runs)]  # fmt: skip
    def bwd_cells(r):
        ta = [x - y for x, y in zip(r["a"]["runs_fwdbwd"], r["a"]["runs_fwd"])]
        tb = [x - y for x, y in zip(r["b"]["runs_fwdbwd"], r["b"]["runs_fwd"])]
        ratio = [b / a for a, b in zip(ta, tb)]
        return [f"{statistics.median(ta):.3f} / {statistics.median(tb):.3f}",
                f"{statistics.median(ratio):.4f} ({sum(x < 1 for x in ratio)}/{len(ratio)})"]

    out += _ab_rows(runs, bwd_cells)
    out += [""] + [f"Source (run {i + 1}): `{p}`." for i, p in enumerate(paths)]
    return "\n".join(out)


def render_host(paths: list[str]) -> str:
    """benchmarks/bench_host.py: host time per call with the GPU kept busy; one table per file
    (each run's host, named in its source line)."""
    return "\n\n".join(_render_host_one(p) for p in paths)


def _render_host_one(path: str) -> str:
    data = _read(path)
    stream = "method_stream" in data
    head = "| op | forward host µs | backward host µs |" + (" stream: forward / backward µs |" if stream else "")
    out = [f"one call: {data['method']}" + (f"; stream: {data['method_stream']}" if stream else "") + ":", "",
           head + " syncs fwd / bwd |", "|---|---:|---:|" + ("---:|" if stream else "") + "---:|"]  # fmt: skip
    for r in data["rows"]:
        cells = [r["op"], r["fwd_host_us"], r["bwd_host_us"] if r["bwd_host_us"] is not None else "–"]
        if stream:
            cells.append(f"{r['fwd_host_us_stream']} / {r['bwd_host_us_stream']}")
        cells.append(f"{r['fwd_syncs']} / {r['bwd_syncs'] if r['bwd_syncs'] is not None else '–'}")
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    if data.get("step_rows"):  # the backward in a step: one backward() over many ops
        out += ["", f"step: {data['method_step']}:", "",
                "| op | one op: backward µs | all ops: backward µs | per op µs |", "|---|---:|---:|---:|"]
        out += [f"| {r['op']} | {r['one_op_us']} | {r['all_ops_us']} ({r['ops']} ops) | {r['per_op_us']} |"
                for r in data["step_rows"]]
    out += ["", source_line(path, data["env"], True)]
    return "\n".join(out)


def render_order(paths: list[str]) -> str:
    """benchmarks/bench_bwd_order.py: the backward's tile orders round robin in one process; one
    file per backward mode (atomic dQ, deterministic), one table."""
    runs = [_read(p) for p in paths]
    rows0 = runs[0]["rows"]
    orders = [k[: -len(" bwd TFLOP/s")] for k in rows0[0] if k.endswith(" bwd TFLOP/s")]
    modes = " / ".join(d["rows"][0]["backward"] for d in runs)
    out = [f"Backward TFLOP/s, {modes}; in parentheses the time of index order over the time of that order:", "",
           "| case | " + " | ".join(orders) + " |", "|---|" + "---:|" * len(orders)]  # fmt: skip
    for i, r in enumerate(rows0):
        cells = []
        for o in orders:
            parts = []
            for d in runs:
                x = d["rows"][i]
                ratio = next((v for k, v in x.items() if k.startswith(f"{o} / ")), None)
                parts.append(f"{x[f'{o} bwd TFLOP/s']}" + (f" ({ratio})" if ratio is not None else ""))
            cells.append(" / ".join(parts))
        out.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    out += [""] + [source_line(p, d["env"], True) for p, d in zip(paths, runs)]
    return "\n".join(out)


def render_ab_mimo(paths: list[str]) -> str:
    """benchmarks/ab_mimo.py: two builds of the MiMo sharder round robin in one process."""
    data = _read(paths[-1])
    r0 = data["rows"][0]
    where = "CPU tokens" if r0.get("device") == "cpu" else "`seq_lens*` on the host"
    out = [f"A = `{data['a']}`, B = `{data['b']}`; {data['method']}. B = 8 rows of S = {r0.get('seq', 32768)} tokens, "
           f"cp = 8, rank 3, {where}; in parentheses the ratio to the reference path with the native TE "
           "partition (`ref(fastTE)`, timed in the same process):", "",
           "| chunks | ref(fastTE) µs | A: wall µs | A: host µs | B: wall µs | B: host µs | B / A wall |",
           "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in data["rows"]:
        a, b = r["a"], r["b"]
        out.append(f"| {r['chunks']} | {r['ref_fastTE_us']} | {a['wall_us']} ({a['x_fastTE']}x) | {a['host_us']} | "
                   f"{b['wall_us']} ({b['x_fastTE']}x) | {b['host_us']} | {r['b_over_a_wall']} |")  # fmt: skip
    out += ["", source_line(paths[-1], data["env"], True) if "env" in data else f"Source: `{paths[-1]}`."]
    return "\n".join(out)


def render_ab_host(paths: list[str]) -> str:
    """benchmarks/ab_host.py: the attention entry points' host path in two trees, round robin."""
    data = _read(paths[-1])
    out = [f"A = `{data['a']}`, B = `{data['b']}`; {data['method']}:", "",
           "| call | A µs | B µs | B / A |", "|---|---:|---:|---:|"]  # fmt: skip
    for r in data["rows"]:
        out.append(f"| {r['call']} | {r['a_us']} | {r['b_us']} | {r['b_over_a']} |")
    out += ["", source_line(paths[-1], data["env"], True)]
    return "\n".join(out)


def render_ab_hint(paths: list[str]) -> str:
    """benchmarks/ab_table_hint.py: every rank's backward kernels with and without the window hint."""
    data = _read(paths[-1])
    out = [f"{data['method']}; backward kernels of every rank, summed (Flint 32/4/128, bf16):", "",
           "| tokens | cp | documents | window | no hint ms | hint ms | speedup |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        out.append(f"| {r['T']} | {r['cp']} | {r['doc']} | {r['window']} | {r['bwd_ms_all_ranks_a_nohint']} | "
                   f"{r['bwd_ms_all_ranks_b_hint']} | {r['a_over_b']} |")  # fmt: skip
    out += ["", source_line(paths[-1], data["env"], True)]
    return "\n".join(out)


def render_sink_pair(paths: list[str]) -> str:
    """gpu_run.sh sinkpair: per run, each row's time against ``ncp`` round by round (the ``*_vs_ncp``
    medians and quartiles). ``ncp-null`` is ``ncp`` again: its spread is the method's own floor."""
    out = ["Time against `ncp` (with the sink), round by round: median [quartiles] of the per-round ratios; "
           "below 1 = faster than the sink row:", "",
           "| run | case | no sink: fwd | no sink: fwd+bwd | null row: fwd | null row: fwd+bwd |",
           "|---:|---|---|---|---|---|"]  # fmt: skip

    def q(r, k):
        x = (r or {}).get(k)
        return "–" if not x else f"{x['median']:.4f} [{x['q1']:.4f}, {x['q3']:.4f}]"

    runs = [(path, _read(path)) for path in paths]
    for i, (_, data) in enumerate(runs, 1):
        by = {(r["case"], r["impl"]): r for r in data["rows"]}
        cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
        for c in cases:
            ns, nl = by.get((c, "ncp-nosink")), by.get((c, "ncp-null"))
            out.append(f"| {i} | {c} | {q(ns, 'fwd_vs_ncp')} | {q(ns, 'fwdbwd_vs_ncp')} | {q(nl, 'fwd_vs_ncp')} | "
                       f"{q(nl, 'fwdbwd_vs_ncp')} |")  # fmt: skip
    out.append("")
    out += [source_line(path, data["env"], True) for path, data in runs]
    return "\n".join(out)


RENDER = {"attn": render_attn, "attn-extra": render_attn_extra, "mimo": render_mimo, "flint": render_flint, "ab": render_ab, "ab-bwd": render_ab_bwd, "host": render_host,
          "tried": render_tried, "order": render_order, "ab-mimo": render_ab_mimo, "ab-hint": render_ab_hint,
          "ab-host": render_ab_host, "sink-pair": render_sink_pair}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------


def blocks(page: str) -> list[tuple[str, list[str]]]:
    """(kind, sources) of every generated block, in page order."""
    return [(m.group(1), m.group(2).split()) for m in BLOCK.finditer(page)]


def render_page(page: str, sources: dict | None = None) -> str:
    """The page with every block re-rendered; ``sources`` maps a kind to new source paths."""
    sources = sources or {}

    def sub(m):
        kind = m.group(1)
        paths = tried_sources() if kind == "tried" else sources.get(kind, m.group(2).split())
        if kind not in RENDER:
            raise SystemExit(f"render_records: unknown block kind {kind!r}")
        body = RENDER[kind](paths)
        return f"<!-- BEGIN GENERATED {kind} {' '.join(paths)} -->\n{body}\n<!-- END GENERATED {kind} -->"

    return BLOCK.sub(sub, page)


def _is_gpu_run(kind: str, path: str) -> bool:
    data = _read(path)
    return data.get("device") == "cuda" if kind == "mimo" else bool(data.get("cp"))


def import_run(directory: str, page: str) -> dict:
    """Copies DIR/bench_{attn,mimo,flint,host,order,order_det}.json into benchmarks/results/; the new
    sources per kind."""
    current = dict(blocks(page))
    new = {}
    for kind, name in (("attn", "bench_attn.json"), ("mimo", "bench_mimo.json"), ("flint", "bench_flint.json"),
                       ("host", "bench_host.json"), ("order", "bench_order.json"), ("order-det", "bench_order_det.json")):
        src = os.path.join(directory, name)
        if not os.path.exists(src):
            continue
        with open(src) as f:
            env = json.load(f)["env"]
        dest = f"{RESULTS}/{env['date'][:10]}_{env['commit']}_{kind}.json"
        shutil.copyfile(src, os.path.join(ROOT, dest))
        print(f"render_records: {src} -> {dest}")
        if kind == "attn":
            new["attn"] = new["attn-extra"] = [dest]
        elif kind in ("host", "order"):  # one machine: the GPU (its host)
            new[kind] = [dest]
        elif kind == "order-det":
            new["order"] = new.get("order", []) + [dest]
        else:  # replace the source of the same machine kind, keep the other
            gpu = _is_gpu_run(kind, dest)
            new[kind] = [p for p in current.get(kind, []) if _is_gpu_run(kind, p) != gpu] + [dest]
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--import", dest="run_dir", default=None, help="a gpu_run.sh output folder ($OUT)")
    ap.add_argument("--attn", default=None, help="attention JSON for the attn and attn-extra blocks")
    ap.add_argument("--mimo", action="append", default=None, help="MiMo JSON (repeat for several machines)")
    ap.add_argument("--flint", action="append", default=None, help="Flint JSON (repeat for several machines)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a page differs from its sources")
    ap.add_argument("--prune", action="store_true", help="delete results files no page cites")
    ap.add_argument("--page", action="append", default=None, help="the page(s); default BENCHMARKS.md and docs/EXPERIMENTS.md")
    args = ap.parse_args(argv)
    paths = args.page or [PAGE, EXPERIMENTS]
    pages = {}
    for path in paths:
        with open(path) as f:
            pages[path] = f.read()
    if args.check:
        bad = [path for path, text in pages.items() if render_page(text) != text]
        for path in bad:
            print(f"render_records: {path} differs from its sources; run python benchmarks/render_records.py")
        return 1 if bad else 0
    sources = import_run(args.run_dir, "\n".join(pages.values())) if args.run_dir else {}
    if args.attn:
        sources["attn"] = sources["attn-extra"] = [args.attn]
    for kind in ("mimo", "flint"):
        if getattr(args, kind):
            sources[kind] = getattr(args, kind)
    for path in pages:
        pages[path] = render_page(pages[path], sources)
        with open(path, "w") as f:
            f.write(pages[path])
    text = "\n".join(pages.values())
    cited = {p for _, srcs in blocks(text) for p in srcs}
    stale = sorted(f"{RESULTS}/{n}" for n in os.listdir(os.path.join(ROOT, RESULTS))
                   if f"{RESULTS}/{n}" not in cited and f"{RESULTS}/{n}" not in text)  # fmt: skip
    for path in stale:
        if args.prune:
            os.remove(os.path.join(ROOT, path))
        print(f"render_records: {'removed' if args.prune else 'not cited by a page'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
