"""Scale benchmark (issue 11): our profiles and the anchors' own runs, per stage time and memory.

    python bench/run.py --layers 2 --out bench-out/   # GPU: full-shape fixtures, 2 of 36 blocks at full width
    python bench/run.py --smoke --out /tmp/bench      # CPU: tiny fixtures, the same code path, small settings

Builds the fixtures (pinned in memory: the committed model YAMLs are left alone), runs each profile
through the pipeline and each anchor directly, every one in a fresh subprocess (so peak host RSS is
per run), and writes `bench.md` (the tables, also printed) and `bench.json` (raw figures) to --out.
Each anchor's output is also scored on the held-out set its profile is scored on, after its timed
stages (speed is compared beside fidelity, never alone).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python bench/run.py` from a checkout, installed or not

PROFILES = ("awq4", "autoround-q3", "sens-q3", "codec-fp8")
FULL_BLOCKS = 36  # the real generator's decoder blocks
BLOCK_STAGES = ("measure", "quantize", "evaluate", "export")  # stages whose work grows with the block count
# --smoke: settings small enough for 2 CPU cores; applied only where a stage has the key.
SMOKE = {"calibrate": {"nsamples": 4, "seqlen": 64},
         "measure": {"nsamples": 4, "seqlen": 64, "iters": 2, "batch_size": 2},
         "quantize": {"nsamples": 4, "seqlen": 64, "iters": 2, "batch_size": 2, "heldout_nsamples": 2, "heldout_seqlen": 64},
         "evaluate": {"nsamples": 2, "seqlen": 64}}
GIB_LIMIT = 8.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- fixtures and pins

def pinned(spec, path: Path):
    """The model spec with every file of `path` pinned (in memory only)."""
    from pipelines.checkpoint import sha256_file
    from pipelines.source import snapshot_files

    return dataclasses.replace(spec, files={f: sha256_file(path / f) for f in snapshot_files(path)})


def build_fixtures(model: str, layers: int | None, work: Path, device: str, codec_needed: bool = True,
                   backbone_needed: bool = True) -> dict:
    """Generator fixture (N blocks), its codec fixture and the anchors' Qwen3 backbone (each when needed);
    reused when there."""
    from pipelines.codec_fixtures import write_codec_fixture
    from pipelines.fixtures import write_fixture
    from pipelines.source import load_model_spec

    from bench.anchors import write_backbone

    gen_spec = load_model_spec(model)
    codec_spec = load_model_spec(gen_spec.codec)
    gen = work / f"{gen_spec.fixture}-L{layers or 'all'}-{device}"
    codec = work / codec_spec.fixture
    backbone = work / f"qwen3-{gen.name}"
    writers = [(gen, lambda p: write_fixture(gen_spec.fixture, p, layers=layers, device=device))]
    if backbone_needed:  # a second copy of the backbone's weights: 16 GB at 36 blocks
        writers.append((backbone, lambda p: write_backbone(gen, p)))
    if codec_needed:
        writers.append((codec, lambda p: write_codec_fixture(codec_spec.fixture, p)))
    for path, write in writers:
        if not path.exists():  # every writer is atomic: a folder that exists is complete
            started = time.perf_counter()
            write(path)
            log(f"wrote {path} in {time.perf_counter() - started:.1f} s")
    return {"generator": (pinned(gen_spec, gen), gen), "codec": (pinned(codec_spec, codec) if codec.exists() else codec_spec, codec), "backbone": backbone}


def block_fixture(model: str, work: Path, layers: int, device: str) -> Path:
    """The generator fixture `model` with `layers` blocks under `work` (written once), or the
    committed tiny one: what the one-block scripts (awq_search, autoround_settings) run on."""
    from pipelines.fixtures import write_fixture
    from pipelines.source import load_model_spec, resolve_path

    if model == "tiny":
        return resolve_path(load_model_spec("tiny"))
    path = Path(work) / f"{model}-L{layers}"
    if not path.exists():
        started = time.perf_counter()
        write_fixture(model, path, layers=layers, device=device)
        log(f"fixture {path}: {time.perf_counter() - started:.0f} s")
    return path


def bench_profile(name: str, model: str, work: Path, smoke: bool, sets: dict | None = None,
                  taken: set | None = None) -> Path:
    """A copy of the profile without the free-running evaluation (an evaluation with its own cost,
    not what the speed and memory targets are about: its gate bounds go with it); with `smoke`, its
    per-model overrides for `model` shrunk by SMOKE; `sets` ({stage: {key: value}}, --set) applied
    where the stage has the key, each one applied added to `taken` as "stage.key"."""
    import yaml

    from pipelines.api import plan
    from pipelines.profile import profile_path

    raw = yaml.safe_load(profile_path(name).read_text())
    prof = plan(name, model)
    raw["stages"].pop("freerun", None)
    for bound in ("max", "min"):
        gate = (raw["stages"].get("gate") or {}).get(bound) or {}
        for key in [k for k in gate if k.startswith("free.")]:
            del gate[key]
    over = raw.setdefault("models", {}).setdefault(model, {}) or {}
    over.pop("freerun", None)
    for stage, params in prof.stages.items():
        fields = {f.name for f in dataclasses.fields(getattr(params, "config", params))}
        small = {k: v for k, v in SMOKE.get(stage, {}).items() if k in fields} if smoke else {}
        small |= {k: v for k, v in (sets or {}).get(stage, {}).items() if k in fields}
        if taken is not None:
            taken |= {f"{stage}.{k}" for k in (sets or {}).get(stage, {}) if k in fields}
        if small:
            over[stage] = {**(over.get(stage) or {}), **small}
    for m in raw["models"].values():
        if isinstance(m, dict):
            m.pop("freerun", None)
    raw["models"][model] = over
    out = work / "profiles" / f"{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


# ---------------------------------------------------------------- children (one per run)

def child(job_file: str) -> None:
    """Runs one profile or anchor and writes its figures next to the job."""
    job = json.loads(Path(job_file).read_text())
    started = time.perf_counter()
    if job["what"] == "profile":
        from pipelines.api import build_from
        from pipelines.source import ModelSpec

        spec = ModelSpec(**{**job["spec"], "yaml_path": Path(job["spec"]["yaml_path"])})
        ctx = build_from(job["profile"], spec, model_path=job["snapshot"], use_cache=job.get("use_cache", False),
                         cache_root=job["cache"], bundle_root=Path(job["bundles"]))
        out = {"stages": ctx.stats, "gate": ctx.results.get("gate", {}).get("status"),
               "bundle_gib": round(sum(p.stat().st_size for p in Path(ctx.bundle).rglob("*") if p.is_file()) / 2**30, 3)}
        if "evaluate" in ctx.results:
            ev = ctx.results["evaluate"]
            out["fidelity"] = {"dataset": ev["dataset"], "metrics": ev["metrics"]}
            if "baseline" in ev:
                out["fidelity_baseline"] = {"method": ev["baseline"]["method"], "metrics": ev["baseline"]["metrics"]}
    else:
        from bench.anchors import RUNNERS, held_out
        from pipelines.stages import resolve_device

        device = resolve_device("auto")
        stats, layers = RUNNERS[job["what"]](Path(job["snapshot"]), job["settings"], device)
        out = {"stages": stats}
        timed = {**out, **_process_figures(stats, started), "fidelity_failed": "not scored: stopped by --stop-after while scoring"}
        Path(job["result"]).write_text(json.dumps(timed, indent=2))  # kept if the scoring below is cut short
        if job.get("evaluate"):  # outside the stages: their time and memory are the anchor's own
            try:  # a scoring failure is reported beside the anchor's figures, which stay
                out["fidelity"] = held_out(Path(job["generator"]), layers, job["evaluate"], device)
            except Exception as e:
                out["fidelity_failed"] = f"{type(e).__name__}: {e}"
    out.update(_process_figures(out["stages"], started))
    Path(job["result"]).write_text(json.dumps(out, indent=2))


def _process_figures(stats: dict, started: float) -> dict:
    return {"process_wall_s": round(time.perf_counter() - started, 3),
            "process_peak_rss_gib": max(s["peak_rss_gib"] for s in stats.values())}  # stage peaks reset VmHWM


def spawn(name: str, job: dict, out: Path, work: Path, keep: bool, deadline: float | None = None) -> dict:
    """One run in its own process. With `deadline` (a time.monotonic()), a profile's run still going
    then is killed as an interrupted command would be (SIGKILL, no cleanup), its stage cache and
    block checkpoints kept: the same command run again resumes it where it stopped, and its figures
    are then summed over the processes (`merged`). An anchor (the library's own loop, not resumable)
    is killed too: its timed figures are kept if it was scoring, else it starts from nothing next time."""
    job = {**job, "result": str(work / "jobs" / f"{name}.result.json"),
           "cache": str(work / "cache" / name), "bundles": str(work / "bundles" / name)}
    resumable = deadline is not None and job["what"] == "profile"
    attempts_file = work / "jobs" / f"{name}.interrupted.json"
    attempts = json.loads(attempts_file.read_text()) if resumable and attempts_file.exists() else []
    if not attempts:  # a measurement starts from nothing: no stage of an earlier run is reused
        attempts_file.unlink(missing_ok=True)
        shutil.rmtree(job["cache"], ignore_errors=True)
    job["use_cache"] = resumable
    path = work / "jobs" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job, indent=2))
    Path(job["result"]).unlink(missing_ok=True)
    logfile = out / "logs" / f"{name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    if deadline is not None and deadline - time.monotonic() <= 0:
        log(f"{name}: not started (--stop-after reached)")
        return {"failed": "not started: --stop-after reached; run the same command again"}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log(f"{name}: running (log {logfile}){f', resuming after {len(attempts)} interrupted' if attempts else ''}")
    started = time.perf_counter()
    with open(logfile, "a" if attempts else "w") as f:
        offset = f.tell()
        # its own process group (not session): killed with its children here, and with this command by whoever kills it
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(path)], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, process_group=0)
        try:
            rc = proc.wait(timeout=None if deadline is None else deadline - time.monotonic())
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            if not resumable:
                if Path(job["result"]).exists():
                    log(f"{name}: stopped by --stop-after while scoring its output; its timed figures are kept")
                    return json.loads(Path(job["result"]).read_text())
                log(f"{name}: stopped by --stop-after; an anchor is not resumable: it starts from nothing next time")
                return {"failed": "stopped by --stop-after (an anchor is not resumable)"}
            with open(logfile) as lf:
                lf.seek(offset)
                finished, running = stage_lines(lf.read())
            done = len(list(Path(job["cache"]).glob("quantize/*.partial/block-*.safetensors")))
            attempts.append({"wall_s": round(time.perf_counter() - started, 3), "finished": finished,
                             "killed_in": running, "blocks_checkpointed": done})
            attempts_file.write_text(json.dumps(attempts, indent=1))
            msg = (f"stopped by --stop-after in stage {running or '(none yet)'}"
                   f"{f' ({done} blocks checkpointed)' if running == 'quantize' else ''}: run the same command again to resume")
            log(f"{name}: {msg}")
            return {"failed": msg}
    if not keep:
        shutil.rmtree(job["cache"], ignore_errors=True)
        shutil.rmtree(job["bundles"], ignore_errors=True)
    attempts_file.unlink(missing_ok=True)
    if rc != 0 or not Path(job["result"]).exists():
        tail = logfile.read_text().strip().splitlines()[-1:] or ["(no output)"]
        log(f"{name}: FAILED (exit {rc}): {tail[0]}")
        return {"failed": f"exit {rc}: {tail[0]}"}
    res = json.loads(Path(job["result"]).read_text())
    if job["what"] == "profile":
        res["block_s"] = block_walls(logfile.read_text())
    if attempts:
        res["stages"] = merged(attempts, res["stages"])
        res["process_peak_rss_gib"] = max(s["peak_rss_gib"] for s in res["stages"].values() if "peak_rss_gib" in s)
        res["interrupted_processes"] = attempts
    log(f"{name}: done in {res['process_wall_s']} s")
    return res


STAGE_DONE = re.compile(r"^stage (\w+): done in ([\d.]+) s \(peak host RSS ([\d.]+) GiB(?:, GPU allocated ([\d.]+) GiB)?\)$")
STAGE_RUNNING = re.compile(r"^stage (\w+): running ")


def stage_lines(text: str) -> tuple[dict, str | None]:
    """From a run's log (pipelines/stages.py's lines): the stages it finished, with their wall and
    peaks, and the stage it was still in."""
    finished, running = {}, None
    for line in text.splitlines():
        if m := STAGE_RUNNING.match(line):
            running = m[1]
        elif m := STAGE_DONE.match(line):
            finished[m[1]] = {"wall_s": float(m[2]), "peak_rss_gib": float(m[3])} | (
                {"gpu_peak_allocated_gib": float(m[4])} if m[4] else {})
            running = None
    return finished, running


BLOCK_LINE = re.compile(r"^.+ block (\d+) of \d+: ([\d.]+) s")


def block_walls(text: str) -> dict[str, list[float]]:
    """Per stage, each block's wall from the engine's block lines, in block order (a block that a
    killed process started and the next one redid: the finished run's)."""
    out, stage = {}, None
    for line in text.splitlines():
        if m := STAGE_RUNNING.match(line):
            stage = m[1]
        elif (m := BLOCK_LINE.match(line)) and stage:
            out.setdefault(stage, {})[int(m[1])] = float(m[2])
    return {k: [v[i] for i in sorted(v)] for k, v in out.items()}


def merged(attempts: list[dict], last: dict) -> dict:
    """Each stage's figures over the processes of a run resumed after kills: its wall is the sum of
    the time each process spent in it (a killed process's time in the stage it was killed in is its
    wall less the stages it finished: its start-up and the work after its last checkpoint are
    counted, an over-estimate); its peaks the largest each process reported (a killed process
    reported none for the stage it was killed in). A stage the last process found cached was
    finished by an earlier one."""
    out = {}
    for stage, st in last.items():
        walls, peaks = [], [] if st.get("cached") else [st]
        for a in attempts:
            if stage in a["finished"]:
                walls.append(a["finished"][stage]["wall_s"])
                peaks.append(a["finished"][stage])
            elif a["killed_in"] == stage:
                walls.append(round(a["wall_s"] - sum(f["wall_s"] for f in a["finished"].values()), 3))
        if not st.get("cached"):
            walls.append(st["wall_s"])
        row = {"wall_s": round(sum(walls), 3), "wall_s_per_process": walls}
        for key in ("peak_rss_gib", "gpu_peak_allocated_gib", "gpu_peak_reserved_gib"):
            vals = [p[key] for p in peaks if key in p]
            if vals:
                row[key] = max(vals)
        out[stage] = row
    return out


# ---------------------------------------------------------------- figures

def median_run(tries: list[dict]) -> dict:
    """The run whose quantize stage took the median time (a failure wins: it is reported), with
    every run's quantize wall beside it."""
    failed = [t for t in tries if "stages" not in t]
    if failed:
        return failed[0]
    walls = [t["stages"]["quantize"]["wall_s"] for t in tries]
    med = sorted(range(len(tries)), key=walls.__getitem__)[(len(tries) - 1) // 2]
    return {**tries[med], "quantize_wall_s_runs": walls}


def median(walls: list[float] | None) -> float | None:
    """A block's typical wall: the median over the blocks (past the compile and first calls of the
    first, and of a resumed process's first, when there are three or more)."""
    return round(statistics.median(walls), 2) if walls else None


def totals(stages: dict) -> dict:
    """Sum of stage walls; the largest of each peak."""
    keys = ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib", "peak_rss_gib")
    out = {"wall_s": round(sum(s["wall_s"] for s in stages.values()), 3)}
    out.update({k: max(s[k] for s in stages.values()) for k in keys if all(k in s for s in stages.values())})
    return out


def extrapolated(stage: str, wall: float, layers: int) -> float:
    return round(wall * FULL_BLOCKS / layers, 1) if stage in BLOCK_STAGES else wall


def comparisons(runs: dict, layers: int) -> list[dict]:
    from bench.anchors import ANCHORS

    rows = []
    for profile in ("awq4", "autoround-q3", "sens-q3"):
        ours = runs.get(profile, {}).get("stages", {}).get("quantize")
        if not ours:
            continue
        for anchor in [a for a, p in ANCHORS.items() if p == profile] or [None]:
            rows.append(_comparison(profile, ours, anchor, runs, layers))
    return rows


def _comparison(profile: str, ours: dict, anchor: str | None, runs: dict, layers: int) -> dict:
    theirs = runs.get(anchor, {}).get("stages", {}).get("quantize") if anchor else None
    our_blocks = runs[profile].get("block_s", {}).get("quantize") or []
    row = {"profile": profile, "anchor": anchor, "ours_quantize_s": ours["wall_s"],
           "ours_per_block_s": round(ours["wall_s"] / layers, 2),
           "ours_block_median_s": median(our_blocks),
           "ours_36_blocks_s_extrapolated": round(ours["wall_s"] / layers * FULL_BLOCKS, 1)}
    if theirs:
        row.update({"anchor_quantize_s": theirs["wall_s"], "anchor_per_block_s": round(theirs["wall_s"] / layers, 2),
                    "anchor_block_median_s": median(theirs.get("block_s")),
                    "anchor_36_blocks_s_extrapolated": round(theirs["wall_s"] / layers * FULL_BLOCKS, 1),
                    "ratio": round(ours["wall_s"] / theirs["wall_s"], 3)})
        if min(len(our_blocks), len(theirs.get("block_s") or [])) >= 3:  # past the first block's compile and first calls: with fewer, those decide
            row["block_ratio"] = round(row["ours_block_median_s"] / row["anchor_block_median_s"], 3)
        load = runs[anchor]["stages"].get("load")
        if load:  # our quantize stage reads its weights and sets the library up itself; the anchor does that in `load`
            both = theirs["wall_s"] + load["wall_s"]
            row.update({"anchor_load_quantize_s": round(both, 3), "ratio_with_load": round(ours["wall_s"] / both, 3)})
    return row


def targets(runs: dict, comps: list[dict], gpu: bool) -> list[dict]:
    out = []

    def add(target, measured, met):
        out.append({"target": target, "measured": measured, "met": met})

    for p in ("awq4", "autoround-q3", "sens-q3"):
        if "stages" in runs.get(p, {}):
            peak = totals(runs[p]["stages"]).get("gpu_peak_allocated_gib")
            add(f"{p}: peak GPU allocated <= 8 GiB", f"{peak} GiB" if gpu else "no GPU",
                ("met" if peak <= GIB_LIMIT else "not met") if gpu else "n/a")
    # issue 16's targets: on one H200 awq4 <= 1/4 of autoawq at its defaults; on the CPU (CI's smoke) <= 1/2
    limits = {("awq4", "autoawq-defaults"): 0.25 if gpu else 0.5, ("autoround-q3", "auto-round-defaults"): 1.0,
              ("awq4", "autoawq"): 0.5, ("autoround-q3", "auto-round"): 1.0}
    for c in comps:
        if (c["profile"], c["anchor"]) in limits:
            r, lim = c.get("ratio"), limits[c["profile"], c["anchor"]]
            add(f"{c['profile']}: quantize wall <= {lim} x {c['anchor']}", f"{r} x" if r else "anchor not run",
                ("met" if r <= lim else "not met") if r else "n/a")
            if c.get("block_ratio"):
                r = c["block_ratio"]
                add(f"{c['profile']}: median block <= {lim} x {c['anchor']}'s",
                    f"{r} x ({c['ours_block_median_s']} s against {c['anchor_block_median_s']} s)",
                    "met" if r <= lim else "not met")
    for p in PROFILES:
        if "stages" in runs.get(p, {}):
            rss = runs[p]["process_peak_rss_gib"]
            add(f"{p}: peak host RSS <= 8 GiB", f"{rss} GiB", "met" if rss <= GIB_LIMIT else "not met")
    if "stages" in runs.get("codec-fp8", {}):
        wall = totals(runs["codec-fp8"]["stages"])["wall_s"]
        add("codec-fp8: all stages < 60 s", f"{wall} s", "met" if wall < 60 else "not met")
    return out


def fmt(v) -> str:
    return "-" if v is None else str(v)


def markdown(report: dict) -> str:
    n = report["layers"]
    how = "measured" if n == FULL_BLOCKS else "extrapolated"
    lines = [f"GPU: {report['gpu']}  ", f"Command: `{report['command']}`  ",
             f"Generator: {report['model']} with {n} of {FULL_BLOCKS} blocks at full width; codec: {report['codec']}  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + "  ",
             f"Each profile and anchor run {report['repeat']} time(s) in turn; figures from the run with the median "
             "quantize wall (every run's in bench.json, `quantize_wall_s_runs`)", "",
             "### Per stage (measured)", "",
             "| run | stage | wall s | GPU peak allocated GiB | GPU peak reserved GiB | peak RSS GiB "
             f"| wall s, {FULL_BLOCKS} blocks ({how}) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, run in report["runs"].items():
        if "stages" not in run:
            lines.append(f"| {name} | failed: {run['failed']} | | | | | |")
            continue
        scale = name != "codec-fp8"
        rows = list(run["stages"].items()) + [("**total**", totals(run["stages"]))]
        for stage, s in rows:
            ext = (round(sum(extrapolated(k, v["wall_s"], n) for k, v in run["stages"].items()), 1) if stage == "**total**"
                   else extrapolated(stage, s["wall_s"], n)) if scale else None
            lines.append(f"| {name} | {stage} | {s['wall_s']} | {fmt(s.get('gpu_peak_allocated_gib'))} "
                         f"| {fmt(s.get('gpu_peak_reserved_gib'))} | {s['peak_rss_gib']} | {fmt(ext)} |")
    for name, run in report["runs"].items():
        if run.get("interrupted_processes"):
            kills = ", ".join(f"{a['wall_s']} s in stage {a['killed_in']}" for a in run["interrupted_processes"])
            lines += ["", f"{name}: resumed after {len(run['interrupted_processes'])} killed process(es) ({kills}); "
                      "each stage's wall is summed over the processes (`wall_s_per_process` in bench.json), its "
                      "peaks the largest any process reported"]
    lines += ["", f"Extrapolated = measured x {FULL_BLOCKS}/{n} for {', '.join(BLOCK_STAGES)} (their fixed costs are "
              "scaled too, so it over-estimates); other stages as measured. Anchor `load` is not scaled.", "",
              "### Ours vs the anchors (quantize stage vs the library's `quantize()`)", "",
              "| profile | anchor | ours s | anchor s | ratio ours/anchor | anchor load + quantize s | ratio ours/(load + "
              f"quantize) | ours s/block | anchor s/block | ours median block s | anchor median block s "
              f"| ratio of medians | ours s, {FULL_BLOCKS} blocks ({how}) | anchor s, {FULL_BLOCKS} blocks ({how}) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in report["comparisons"]:
        lines.append(f"| {c['profile']} | {fmt(c['anchor'])} | {c['ours_quantize_s']} | {fmt(c.get('anchor_quantize_s'))} "
                     f"| {fmt(c.get('ratio'))} | {fmt(c.get('anchor_load_quantize_s'))} | {fmt(c.get('ratio_with_load'))} "
                     f"| {c['ours_per_block_s']} | {fmt(c.get('anchor_per_block_s'))} | {fmt(c['ours_block_median_s'])} "
                     f"| {fmt(c.get('anchor_block_median_s'))} | {fmt(c.get('block_ratio'))} "
                     f"| {c['ours_36_blocks_s_extrapolated']} | {fmt(c.get('anchor_36_blocks_s_extrapolated'))} |")
    lines += ["", "### Fidelity on the held-out set (the evaluate stage's `compare` against BF16, same set)", "",
              "| run | held-out set (sha256) | kl_audio_mean | kl_audio_max | top1_audio_mean | kl_text |",
              "|---|---|---:|---:|---:|---:|"]
    for name, run in report["runs"].items():
        if "fidelity_failed" in run:
            lines.append(f"| {name} | failed: {run['fidelity_failed']} | | | | |")
        for label, fid in ((name, run.get("fidelity")), (f"{name}: {run.get('fidelity_baseline', {}).get('method')} on "
                                                          "the same grid", run.get("fidelity_baseline"))):
            if fid and "kl_audio_mean" in fid["metrics"]:  # the generator's (the codec's evaluation scores audio)
                m, ds = fid["metrics"], fid.get("dataset") or run["fidelity"]["dataset"]
                lines.append(f"| {label} | {ds['name']} ({ds['sha256'][:12]}) | {m['kl_audio_mean']} | {m['kl_audio_max']} "
                             f"| {m['top1_audio_mean']} | {m['kl_text']} |")
    lines += ["", "### Targets (issue 16)", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['met']} |" for t in report["targets"]]
    if report["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, help="decoder blocks to build (full width); default all 36 (1 with --smoke)")
    p.add_argument("--out", default="artifacts/bench", help="folder for bench.md, bench.json and the run logs")
    p.add_argument("--work", help="fixtures, caches and bundles (default OUT/work; fixtures are reused)")
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated subset")
    p.add_argument("--anchors", action=argparse.BooleanOptionalAction, default=None,
                   help="run autoawq and auto-round directly (default: on, off with --smoke)")
    p.add_argument("--only-anchors", help="comma-separated subset of the anchors (default all of the profiles')")
    p.add_argument("--ours", action=argparse.BooleanOptionalAction, default=True,
                   help="run our profiles (off: only their anchors, with the profiles' settings; for an anchor that "
                        "needs a command of its own)")
    p.add_argument("--smoke", action="store_true", help="tiny fixtures on CPU with small settings (CI)")
    p.add_argument("--keep", action="store_true", help="keep each run's stage cache and bundle")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each profile and anchor, in turn; the figures are the median run's (default 1)")
    p.add_argument("--stop-after", type=float, metavar="SECONDS",
                   help="SECONDS after this command started, kill the profile's run still going, keeping its stage "
                        "cache and block checkpoints: the same command again resumes it, and its figures are summed "
                        "over the processes (runs longer than one command may take)")
    p.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="override a stage parameter in each of our profiles that has it, for an A/B on the same "
                        "machine (e.g. --set quantize.enable_deterministic_algorithms=false); anchors keep theirs")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    deadline = None if args.stop_after is None else time.monotonic() + args.stop_after

    import torch

    from bench.anchors import ANCHORS, settings
    from pipelines.api import plan
    from pipelines.errors import PipelineError
    from pipelines.profile import known_profiles, parse_overrides
    from pipelines.environment import library_versions

    try:
        sets = parse_overrides(args.set)
    except PipelineError as e:
        sys.exit(f"bench: {e}")

    device = "cpu" if args.smoke else ("cuda" if torch.cuda.is_available() else "cpu")
    model = "tiny" if args.smoke else "full-shape"
    layers = args.layers or (1 if args.smoke else None)
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # children too: the smoke run is a CPU run
    requested = args.profiles.split(",")
    anchors = args.anchors if args.anchors is not None else not args.smoke
    fx = build_fixtures(model, layers, work, device, codec_needed=any(p.startswith("codec") for p in requested),
                        backbone_needed=anchors)
    (gen_spec, gen_path), (codec_spec, codec_path) = fx["generator"], fx["codec"]
    layers = json.loads((gen_path / "config.json").read_text())["language_config"]["num_hidden_layers"]

    jobs, skipped, taken = {}, {}, set()
    for name in requested:
        if name not in known_profiles():
            skipped[name] = "no configs/profiles/" + name + ".yaml yet"
            continue
        spec, path = (codec_spec, codec_path) if name.startswith("codec") else (gen_spec, gen_path)
        profile = str(bench_profile(name, spec.name, work, args.smoke, sets, taken))
        job = {"what": "profile", "profile": profile, "snapshot": str(path),
               "spec": {**dataclasses.asdict(spec), "yaml_path": str(spec.yaml_path)}}
        jobs[name] = job
    unused = sorted({f"{st}.{k}" for st, kv in sets.items() for k in kv} - taken)
    if unused:
        sys.exit(f"bench: --set {', '.join(unused)}: no profile in --profiles has that stage parameter")
    if anchors:
        for anchor, profile in ANCHORS.items():
            if profile not in known_profiles():
                skipped[anchor] = f"its settings come from {profile}, which does not exist yet"
                continue
            if profile not in requested:
                skipped[anchor] = f"its profile {profile} is not in --profiles"
                continue
            if args.only_anchors and anchor not in args.only_anchors.split(","):
                skipped[anchor] = "not in --only-anchors"
                continue
            copy = str(bench_profile(profile, gen_spec.name, work, args.smoke)) if args.smoke else None  # the same shrink
            s = settings(anchor, gen_spec.name, copy)
            ev = plan(jobs[profile]["profile"], gen_spec.name).stages.get("evaluate")  # the set ours is scored on
            jobs[anchor] = {"what": anchor, "snapshot": str(fx["backbone"]), "settings": s, "generator": str(gen_path),
                            "evaluate": ev and {k: getattr(ev, k) for k in ("dataset", "nsamples", "seqlen", "batch_size")}}
    else:
        skipped["anchors"] = "not requested (--anchors)"
    if not args.ours:
        jobs = {k: v for k, v in jobs.items() if v["what"] != "profile"}
        skipped["ours"] = "not requested (--no-ours)"
    tries = {name: [] for name in jobs}
    for _ in range(args.repeat):  # rounds in turn (ours, the anchors, ours, ...): a drift of the machine hits both
        for name, job in jobs.items():
            tries[name].append(spawn(name, job, out, work, args.keep, deadline))
    runs = {name: median_run(t) | {k: v for k, v in jobs[name].items() if k == "settings"} for name, t in tries.items()}

    comps = comparisons(runs, layers)
    report = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "none (CPU run)",
        "versions": library_versions(), "model": model, "codec": codec_spec.name, "layers": layers,
        "full_blocks": FULL_BLOCKS, "repeat": args.repeat, "runs": runs, "skipped": skipped, "comparisons": comps,
        "targets": targets(runs, comps, device == "cuda"),
    }
    table = markdown(report)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
