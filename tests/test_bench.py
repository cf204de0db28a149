"""bench/run.py --smoke: the benchmark's own code path on CPU with the tiny fixtures (issue 11)."""
import json
import subprocess
import sys
from pathlib import Path

from pipelines.profile import known_profiles

ROOT = Path(__file__).resolve().parent.parent
PROFILES = [p for p in ("awq4", "autoround-q3", "sens-q3", "codec-fp8") if p in known_profiles()]


def test_smoke_records_every_profile_and_the_anchors_in_the_same_run(tmp_path):
    """CI's same-run comparison with autoawq and auto-round (issue 16): ratios are printed, never asserted."""
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--anchors", "--repeat", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["layers"] == 1 and report["model"] == "tiny" and report["repeat"] == 2
    for name in PROFILES:
        stages = report["runs"][name].get("stages")
        assert stages, f"{name}: {report['runs'][name]}"
        assert stages["quantize"]["wall_s"] > 0  # a fast stage (the gate) may round to 0.0 s
        assert stages["quantize"]["wall_s"] == min(report["runs"][name]["quantize_wall_s_runs"])  # median of 2: the lower
        assert all(s["wall_s"] >= 0 and s["peak_rss_gib"] > 0 for s in stages.values())
        assert report["runs"][name]["process_peak_rss_gib"] >= max(s["peak_rss_gib"] for s in stages.values())
        assert f"| {name} | quantize |" in proc.stdout  # the printed table has the row
    assert "### Targets" in (out / "bench.md").read_text()
    targets = {t["target"] for t in report["targets"]}
    assert {f"{p}: peak host RSS <= 8 GiB" for p in PROFILES} <= targets
    from bench.anchors import ANCHORS

    for anchor, profile in ANCHORS.items():  # each anchor ran at its own defaults or at our settings, and was compared
        assert report["runs"][anchor].get("stages", {}).get("quantize"), f"{anchor}: {report['runs'][anchor]}"
        row = next(c for c in report["comparisons"] if c["anchor"] == anchor)
        assert row["profile"] == profile and row["ratio"] > 0
        assert row["ratio_with_load"] < row["ratio"]  # the anchor's load (reading, library setup) counted too
        # per block, from our engine's block lines and the library's own loop
        walls = report["runs"][profile]["block_s"]["quantize"]
        assert len(walls) == report["layers"] and row["ours_block_median_s"] == round(walls[0], 2)
        theirs = report["runs"][anchor]["stages"]["quantize"]
        assert len(theirs["block_s"]) == report["layers"] and 0 < sum(theirs["block_s"]) <= theirs["wall_s"]
        assert "block_ratio" not in row  # one block: its first calls would decide the ratio
        assert f"{profile}: quantize wall <= " in "".join(targets) and f"| {profile} | {anchor} |" in proc.stdout
        ours, theirs = report["runs"][profile]["fidelity"], report["runs"][anchor]["fidelity"]
        assert theirs["dataset"] == ours["dataset"]  # scored on the held-out set ours was scored on
        assert theirs["metrics"]["kl_audio_mean"] > 0  # the anchor's quantized layers were scored, not the source's
        if profile == "awq4":  # autoawq's layers, dequantized by its unpacker: AWQ, far better than RTN on its grid
            rtn = report["runs"][profile]["fidelity_baseline"]["metrics"]["kl_audio_mean"]
            assert theirs["metrics"]["kl_audio_mean"] < rtn / 2
    assert "### Fidelity on the held-out set" in (out / "bench.md").read_text()


def test_a_run_stopped_by_stop_after_resumes_and_sums_its_processes(tmp_path):
    """--stop-after kills a profile's run as an interrupted command would and keeps its stage cache;
    the same command again finishes it, and the figures count both processes."""
    from bench.run import stage_lines

    out, work = tmp_path / "bench", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--profiles", "autoround-q3", "--out", str(out),
           "--work", str(work), "--stop-after"]
    for stop in (2, 4, 8, 16):  # the deadline counts from the command's start: past the fixtures, into the run
        first = subprocess.run(cmd + [str(stop)], capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert first.returncode == 0, first.stderr[-2000:]
        cut = json.loads((out / "bench.json").read_text())["runs"]["autoround-q3"]
        if not cut["failed"].startswith("not started"):
            break
    assert cut["failed"].startswith("stopped by --stop-after in stage ")
    interrupted = json.loads((work / "jobs" / "autoround-q3.interrupted.json").read_text())
    assert len(interrupted) == 1 and interrupted[0]["wall_s"] > 0
    second = subprocess.run(cmd + ["600"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    run = json.loads((out / "bench.json").read_text())["runs"]["autoround-q3"]
    assert run["interrupted_processes"] == interrupted
    for stage, st in run["stages"].items():
        assert st["wall_s"] == round(sum(st["wall_s_per_process"]), 3) and st["peak_rss_gib"] > 0, stage
    assert not (work / "jobs" / "autoround-q3.interrupted.json").exists()  # the next run measures from nothing
    assert "resumed after 1 killed process(es)" in (out / "bench.md").read_text()
    # the log lines the figures of a killed process are read from are the stage runner's own
    finished, running = stage_lines((out / "logs" / "autoround-q3.log").read_text())
    assert running is None and set(finished) == set(run["stages"])
    assert finished["quantize"]["wall_s"] == round(run["stages"]["quantize"]["wall_s_per_process"][-1], 1)


def test_figures_of_a_run_resumed_after_kills_are_summed_per_stage():
    """Process 1 killed in quantize, process 2 finished quantize and was killed in evaluate, process 3
    found both cached and finished."""
    from bench.run import merged

    attempts = [{"wall_s": 50.0, "finished": {"calibrate": {"wall_s": 2.0, "peak_rss_gib": 1.0}}, "killed_in": "quantize"},
                {"wall_s": 90.0, "finished": {"quantize": {"wall_s": 60.0, "peak_rss_gib": 7.0,
                                                           "gpu_peak_allocated_gib": 6.0}}, "killed_in": "evaluate"}]
    last = {"calibrate": {"wall_s": 0.01, "peak_rss_gib": 0.5, "cached": True},
            "quantize": {"wall_s": 0.02, "peak_rss_gib": 0.6, "cached": True},
            "evaluate": {"wall_s": 40.0, "peak_rss_gib": 3.0, "gpu_peak_allocated_gib": 7.5}}
    m = merged(attempts, last)
    assert m["calibrate"] == {"wall_s": 2.0, "wall_s_per_process": [2.0], "peak_rss_gib": 1.0}
    assert m["quantize"] == {"wall_s": 108.0, "wall_s_per_process": [48.0, 60.0], "peak_rss_gib": 7.0,
                             "gpu_peak_allocated_gib": 6.0}
    assert m["evaluate"] == {"wall_s": 70.0, "wall_s_per_process": [30.0, 40.0], "peak_rss_gib": 3.0,
                             "gpu_peak_allocated_gib": 7.5}


def test_an_anchor_alone_is_cut_at_stop_after_keeping_only_what_it_finished(tmp_path):
    """--no-ours runs the anchors alone (one that needs a command of its own at 36 blocks). An anchor
    (the library's loop) is not resumable: --stop-after kills it, keeping its timed figures if it was
    already scoring its output, else reporting it not run; a later command runs it from nothing."""
    out, work = tmp_path / "bench", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--profiles", "autoround-q3", "--no-ours",
           "--anchors", "--only-anchors", "auto-round", "--out", str(out), "--work", str(work), "--stop-after"]
    seen = set()
    for stop in (1, 2, 3, 4, 6, 8, 12, 16, 600):
        proc = subprocess.run(cmd + [str(stop)], capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads((out / "bench.json").read_text())
        assert set(report["runs"]) == {"auto-round"} and report["skipped"]["ours"] == "not requested (--no-ours)"
        run = report["runs"]["auto-round"]
        if "stages" not in run:
            assert run["failed"].startswith(("not started", "stopped by --stop-after (an anchor is not resumable)"))
            seen.add(run["failed"].split(":")[0].split(" (")[0])
        elif "fidelity" not in run:  # cut while scoring: the library's own stages were timed
            assert run["fidelity_failed"].startswith("not scored: stopped by --stop-after")
            assert run["stages"]["quantize"]["wall_s"] > 0
            seen.add("timed, not scored")
        else:
            assert run["fidelity"]["metrics"]["kl_audio_mean"] > 0 and "fidelity_failed" not in run
            seen.add("finished")
    assert "finished" in seen and len(seen) >= 2, seen  # the last command ran it from nothing, to the end


def test_blocks_are_compared_by_their_median_past_the_first():
    """Per block, ours (the engine's block lines in the run's log, a resumed block counted once, as
    the process that finished it ran it) against the library's loop: the medians' ratio, once both
    ran three blocks or more."""
    from bench.run import block_walls, comparisons

    log = "\n".join([
        "stage calibrate: running (abc)", "x block 0 of 9: 9.0 s (load 1.00)",  # another stage's engine
        "stage quantize: running (def)", "auto-round block 0 of 4: 30.0 s (load 0.50, hook 29.00), host RSS 1 GiB",
        "auto-round block 1 of 4: 10.0 s (hook 9.00)", "auto-round block 2 of 4: 99.0 s (hook 98.00)",  # killed after
        "stage quantize: running (def)", "auto-round block 2 of 4: 11.0 s (hook 10.00)", "auto-round block 3 of 4: 12.0 s"])
    walls = block_walls(log)
    assert walls == {"calibrate": [9.0], "quantize": [30.0, 10.0, 11.0, 12.0]}
    runs = {"autoround-q3": {"stages": {"quantize": {"wall_s": 63.0}}, "block_s": walls},
            "auto-round-defaults": {"stages": {"quantize": {"wall_s": 50.0, "block_s": [20.0, 10.0, 10.0, 10.0]}}}}
    row = next(r for r in comparisons(runs, 4) if r["anchor"] == "auto-round-defaults")
    assert (row["ours_block_median_s"], row["anchor_block_median_s"], row["block_ratio"]) == (11.5, 10.0, 1.15)
    runs["auto-round-defaults"]["stages"]["quantize"]["block_s"] = [20.0, 10.0]
    assert "block_ratio" not in next(r for r in comparisons(runs, 4) if r["anchor"] == "auto-round-defaults")


def test_gc_walks_counts_auto_rounds_collections_per_block_with_and_without_the_freeze(capsys):
    """bench/gc_walks.py, the figure BENCHMARKS gives for auto-round's collections: a line per block
    and setting, each with collections counted, and gc.collect and the freeze given back after."""
    import gc

    from bench.gc_walks import main
    from quantizers import autoround

    collect, frozen = gc.collect, autoround.collections_of_new_objects_only
    main(["--blocks", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == ["as tune_block runs (objects alive before set aside)",
                                                      "without the freeze"]
    assert all(int(line.split(": ")[1].split()[0]) >= 1 for line in lines), lines  # collections counted
    assert gc.collect is collect and autoround.collections_of_new_objects_only is frozen and not gc.get_freeze_count()


def test_set_overrides_our_profiles_where_the_stage_has_the_key_and_refuses_a_key_none_has(tmp_path):
    """--set is for an A/B on one machine (e.g. determinism off): it lands in the profile copy our run
    builds from, only in profiles whose stage has that parameter; a key that no profile takes is
    refused before anything runs (a misspelt key would otherwise measure the default twice)."""
    import yaml

    from bench.run import bench_profile
    from pipelines.api import plan

    taken: set = set()
    sets = {"quantize": {"enable_deterministic_algorithms": False, "group_size": 64}}
    ar = bench_profile("autoround-q3", "tiny", tmp_path, False, sets, taken)
    fp8 = bench_profile("codec-fp8", "codec-tiny", tmp_path, False, sets, taken)
    assert taken == {"quantize.enable_deterministic_algorithms", "quantize.group_size"}
    q = plan(str(ar), "tiny").stages["quantize"].config
    assert (q.enable_deterministic_algorithms, q.group_size, q.iters) == (False, 64, 200)
    assert "enable_deterministic_algorithms" not in json.dumps(yaml.safe_load(fp8.read_text())["models"])
    # the next GPU A/B: sens-q3's quantize with static graphs (its measure stage has no such key)
    sens = bench_profile("sens-q3", "tiny", tmp_path, False, {"quantize": {"compile_static_shapes": True}}, taken)
    assert plan(str(sens), "tiny").stages["quantize"].config.tuning().compile_static_shapes

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--profiles", "autoround-q3",
                           "--set", "quantize.enable_determinstic_algorithms=false", "--out", str(tmp_path / "o"),
                           "--work", str(tmp_path / "w")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == ("bench: --set quantize.enable_determinstic_algorithms: "
                                                    "no profile in --profiles has that stage parameter")
    assert not (tmp_path / "o" / "bench.json").exists()
