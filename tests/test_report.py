"""`mossquant report`: real bundles (rtn4 with its free-running evaluation, a 3-bit RTN rejected
teacher-forced, codec-fp8) side by side; every table value checked against the manifests, the
plots exist and are real PNGs, the free-running WAVs sit beside the report."""
import json
import shutil

import pytest
import yaml

from pipelines.api import build
from pipelines.cli import main
from pipelines.codec_fixtures import write_codec_fixture
from pipelines.errors import PipelineError
from pipelines.fixtures import write_fixture
from pipelines.report import CODEC_METRICS, GENERATOR_METRICS, REPORT, collect, write_report

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """artifacts-like folder: tiny/{rtn4,rtn3-strict}/v1-*, codec-tiny/codec-fp8/v1-*."""
    base = tmp_path_factory.mktemp("report")
    src = write_fixture("tiny", base / "src" / "tiny")
    codec_src = write_codec_fixture("codec-tiny", base / "src" / "codec-tiny")
    art, cache = base / "artifacts", base / "cache"
    build("rtn4", "tiny", model_path=src, cache_root=cache, bundle_root=art / "tiny" / "rtn4")
    strict = base / "rtn3-strict.yaml"  # a profile the gate rejects: 3-bit RTN held to a 4-bit-plus bar
    strict.write_text(yaml.safe_dump({
        "name": "rtn3-strict", "kind": "generator", "seed": 0,
        "stages": {"quantize": {"method": "rtn", "bits": 3, "group_size": 128, "sym": False},
                   "evaluate": {"nsamples": 2, "seqlen": 48},
                   "gate": {"max": {"kl_audio_mean": 0.05}, "min": {"top1_audio_mean": 0.5}},
                   "export": {}}}, sort_keys=False))
    build(str(strict), "tiny", model_path=src, cache_root=cache, bundle_root=art / "tiny" / "rtn3-strict")
    build("codec-fp8", "codec-tiny", model_path=codec_src, cache_root=cache, bundle_root=art / "codec-tiny" / "codec-fp8")
    return art


def manifests(root, model):
    out = {}
    for m in sorted((root / model).glob("*/v1-*/manifest.json")):
        d = json.loads(m.read_text())
        out[d["profile"]] = d
    return out


def tables(text: str) -> dict[str, list[dict]]:
    """{section heading: rows of its first table as {column: cell}}."""
    out, section, lines = {}, None, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("| ") and section not in out:
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip("|").split("|")))))
            out[section] = rows
    return out


def tables_all(text: str, section: str) -> list[dict]:
    """Every table row under one heading (tables with other columns follow each other)."""
    rows, inside, header = [], False, None
    for line in text.splitlines():
        if line.startswith("#"):
            inside = line.lstrip("#").strip() == section
            header = None
        elif inside and line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
            elif not set(line) <= set("|-"):
                rows.append(dict(zip(header, cells)))
        elif inside and not line.startswith("|"):
            header = None
    return rows


def num(cell: str):
    return None if cell == "—" else float(cell)


def by_profile(rows):
    return {r["profile"]: r for r in rows}


def test_report_lists_every_bundle_with_the_manifests_values(root):
    path = write_report("tiny", root)
    assert path == root / "tiny" / REPORT
    text = path.read_text()
    t = tables(text)
    ms = manifests(root, "tiny")
    assert set(ms) == {"rtn4", "rtn3-strict"}
    assert ms["rtn3-strict"]["status"] == "rejected"

    bundles = by_profile(t["Bundles"])
    assert set(bundles) == set(ms)
    for p, m in ms.items():
        assert m["version"] in bundles[p]["version"] and bundles[p]["status"] == m["status"]
        assert f"({p}/{m['version']}/)" in bundles[p]["version"]  # relative link to the bundle folder
    failed = bundles["rtn3-strict"]["failed checks"]
    assert "kl_audio_mean" in failed and "top1_audio_mean" not in failed  # only the check that failed
    rtn4_failed = [c["metric"] for c in ms["rtn4"]["gate"]["checks"] if not c["passed"]]
    assert all(k.startswith("free.") for k in rtn4_failed)  # teacher-forced it passes
    if rtn4_failed:
        assert all(k in bundles["rtn4"]["failed checks"] for k in rtn4_failed)
    else:
        assert bundles["rtn4"]["failed checks"] == "—"

    free = [r for r in tables_all(text, "Free-running against BF16") if r.get("profile") == "rtn4"]
    metrics = ms["rtn4"]["free_running"]["metrics"]
    assert num(free[0]["free.code_disagreement_ratio"]) == pytest.approx(metrics["free.code_disagreement_ratio"], rel=1e-5)
    assert num(free[0]["free.length_ratio"]) == pytest.approx(metrics["free.length_ratio"], rel=1e-5)
    per_set = {r["set"]: r for r in free[1:]}
    assert set(per_set) == {"moss-heldout-v1", "moss-heldout-v2", "moss-stress-long-v1"}
    for name, r in per_set.items():
        st = ms["rtn4"]["free_running"]["sets"][name]["sampled"]
        assert num(r["length ratio"]) == pytest.approx(st["length_ratio_gmean"], abs=1e-3)
        assert r["code agreement (reroll)"].startswith(f"{st['code_agreement']:.3f}")

    bpw = by_profile(t["Bits per weight"])
    for p, m in ms.items():
        b = m["bits_per_weight"]
        assert num(bpw[p]["effective"]) == pytest.approx(b["effective"], rel=1e-5)
        assert num(bpw[p]["quantized_linear"]) == pytest.approx(b["quantized_linear"], rel=1e-5)
        assert set(b["components"]) == {"backbone_linears", "embeddings", "heads", "norms"}
        for c, v in b["components"].items():
            assert num(bpw[p][c]) == pytest.approx(v["bpw"], rel=1e-5)
        assert num(bpw[p]["headers"]) == pytest.approx(b["header_bits"] / b["source_params"], rel=1e-4)
    assert num(bpw["rtn3-strict"]["backbone_linears"]) < num(bpw["rtn4"]["backbone_linears"])

    fid = by_profile(t["Fidelity against the BF16 source"])
    for p, m in ms.items():
        for k in GENERATOR_METRICS:
            assert num(fid[p][k]) == pytest.approx(m["evaluation"]["metrics"][k], rel=1e-5), (p, k)
    assert fid["rtn4"]["held-out set"] == "moss-heldout-v1 (4×128)"  # rtn4's tiny override
    assert fid["rtn3-strict"]["held-out set"] == "moss-heldout-v1 (2×48)"

    gate = t["Gate verdicts"]
    for p, m in ms.items():
        rows = [r for r in gate if r["profile"] == p]
        assert len(rows) == len(m["gate"]["checks"])
        for r, c in zip(rows, m["gate"]["checks"]):
            assert r["metric"] == c["metric"] and num(r["value"]) == pytest.approx(c["value"], rel=1e-5)
            assert r["check"] == ("pass" if c["passed"] else "**FAIL**") and r["status"] == m["status"]
    assert "Companion codec `codec-tiny`" in text and "](../codec-tiny/REPORT.md)" in text


def test_plots_exist_are_real_pngs_and_are_referenced(root):
    text = write_report("tiny", root).read_text()
    expected = {"bpw_components", "bpw_vs_fidelity", "block_error", "per_codebook", "divergence", "decoded_distance"}
    for stem in expected:
        png = root / "tiny" / f"{stem}.png"
        data = png.read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, stem  # axes, labels and data, not an empty canvas
        assert f"]({stem}.png)" in text
    assert not list((root / "tiny").glob(".report.tmp-*"))
    wavs = sorted((root / "tiny" / "wavs" / "rtn4").iterdir())  # BF16 and quantized, one prompt per set
    assert len(wavs) == 6 and all(w.read_bytes()[:4] == b"RIFF" for w in wavs)
    assert all(f"](wavs/rtn4/{w.name})" in text for w in wavs)


def test_report_is_deterministic(root):
    first = {p.name: p.read_bytes() for p in [write_report("tiny", root), *(root / "tiny").glob("*.png")]}
    write_report("tiny", root)
    assert {n: (root / "tiny" / n).read_bytes() for n in first} == first


def test_bar_components_add_up_to_effective_bpw(root):
    for model in ("tiny", "codec-tiny"):
        for e in collect(model, root):
            assert sum(e.contributions().values()) == pytest.approx(e.bpw["effective"], rel=1e-5)


def test_codec_report_under_its_own_model_name(root):
    text = write_report("codec-tiny", root).read_text()
    t = tables(text)
    [m] = manifests(root, "codec-tiny").values()
    assert m["kind"] == "codec" and m["evaluation"]["dataset"]["name"] == "codec-validation-v1"
    [row] = t["Codec fidelity against the FP32 decode"]
    for k in CODEC_METRICS:
        assert num(row[k]) == pytest.approx(m["evaluation"]["metrics"][k], rel=1e-5), k
    assert num(row["baseline_snr_db"]) == pytest.approx(m["evaluation"]["unquantized_baseline"]["metrics"]["snr_db"], rel=1e-5)
    assert num(row["log_mel_distance_db"]) > 0
    [bpw] = t["Bits per weight"]
    for c, v in m["bits_per_weight"]["components"].items():
        assert num(bpw[c]) == pytest.approx(v["bpw"], rel=1e-5)
    assert "Fidelity against the BF16 source" not in t  # no generator section for a codec
    for stem in ("bpw_components", "codec_bpw_vs_fidelity", "sequence_snr"):
        assert (root / "codec-tiny" / f"{stem}.png").read_bytes()[:8] == PNG
        assert f"]({stem}.png)" in text
    assert not (root / "codec-tiny" / "block_error.png").exists()


def test_newest_version_of_each_profile_is_shown(root, tmp_path):
    art = tmp_path / "artifacts"
    shutil.copytree(root / "tiny", art / "tiny")
    old = next((art / "tiny" / "rtn4").glob("v1-*"))
    new = old.with_name("v1-000000000000")
    shutil.copytree(old, new)
    m = json.loads((new / "manifest.json").read_text())
    m["version"], m["bits_per_weight"]["effective"] = new.name, 7.5
    (new / "manifest.json").write_text(json.dumps(m))
    index = art / "tiny" / "rtn4" / "index.json"  # export records the build order; the copy is the newest
    index.write_text(json.dumps({"versions": [*json.loads(index.read_text())["versions"], new.name]}))
    stray = old.with_name("v1-ffffffffffff")  # not in the index: written before it, so older
    shutil.copytree(old, stray)
    t = tables(write_report("tiny", art).read_text())
    row = by_profile(t["Bits per weight"])["rtn4"]
    assert num(row["effective"]) == 7.5
    assert "v1-000000000000" in by_profile(t["Bundles"])["rtn4"]["version"]


def test_method_baselines_and_scorer_figures_are_shown(root, tmp_path):
    art = tmp_path / "artifacts"
    shutil.copytree(root / "tiny", art / "tiny")
    figures = {"kl_audio_mean": 0.25, "top1_audio_mean": 0.75, "kl_text": 0.5}
    for profile in ("rtn4", "rtn3-strict"):  # the evaluate stage's baseline, as `baseline: rtn` records it
        f = next((art / "tiny" / profile).glob("v1-*")) / "manifest.json"
        m = json.loads(f.read_text())
        m["evaluation"]["baseline"] = {"method": "rtn", "what": "rtn on the bundle's grid", "metrics": figures}
        if profile == "rtn4":
            m["evaluation"]["metrics"]["asr.cer"] = 0.125  # an optional scorer's figure (pipelines/scorers.py)
        f.write_text(json.dumps(m))
    t = tables(write_report("tiny", art).read_text())
    fid = by_profile(t["Fidelity against the BF16 source"])
    assert num(fid["rtn4"]["asr.cer"]) == 0.125 and fid["rtn3-strict"]["asr.cer"] == "—"
    rows = by_profile(t["Against plain RTN on the same grid"])
    ms = manifests(art, "tiny")
    for p in ("rtn4", "rtn3-strict"):  # scored on the evaluate stage's own set
        st = ms[p]["stages"]["evaluate"]
        assert rows[p]["RTN scored on"] == f"moss-heldout-v1 ({st['nsamples']}×{st['seqlen']})"
    for p, row in rows.items():
        for k, v in figures.items():
            assert num(row[f"{k} (rtn)"]) == v
            assert num(row[f"{k} (bundle)"]) == pytest.approx(ms[p]["evaluation"]["metrics"][k], rel=1e-5)


def test_bad_input_is_one_line_and_leaves_nothing(root, tmp_path, capsys):
    with pytest.raises(PipelineError, match=r"no bundles of model 'nope'"):
        write_report("nope", root)
    art = tmp_path / "artifacts"
    shutil.copytree(root / "tiny", art / "tiny")
    for f in art.glob("tiny/*.png"):
        f.unlink()
    (art / "tiny" / REPORT).unlink()
    shutil.rmtree(art / "tiny" / "wavs")  # the earlier report's listening folder
    bad = next((art / "tiny" / "rtn4").glob("v1-*")) / "manifest.json"
    m = json.loads(bad.read_text())
    del m["bits_per_weight"]
    bad.write_text(json.dumps(m))
    with pytest.raises(PipelineError, match=r"manifest.json: key 'bits_per_weight' missing") as e:
        write_report("tiny", art)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in (art / "tiny").iterdir()) == ["rtn3-strict", "rtn4"]  # nothing partial
    with pytest.raises(SystemExit) as e:  # the CLI: one line on stderr, non-zero exit
        main(["report", "tiny", "--root", str(art)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1


def test_cli_writes_the_report(root, capsys):
    main(["report", "codec-tiny", "--root", str(root)])
    assert capsys.readouterr().out.strip() == f"report: {root / 'codec-tiny' / REPORT}"


def test_the_pareto_front_keeps_the_points_nothing_beats():
    from pipelines.report import pareto_front

    pts = [(2.14, 0.02, "a", True), (2.5, 0.007, "b", False), (3.15, 0.006, "c", False), (3.15, 0.0045, "d", False),
           (4.16, 0.009, "e", False), (4.16, 0.003, "f", False), (3.3, 0.005, "g", False)]
    # g has more bits than d and a higher KL; e is beaten by d; c by d at the same bits
    assert pareto_front(pts) == [(2.14, 0.02), (2.5, 0.007), (3.15, 0.0045), (4.16, 0.003)]
