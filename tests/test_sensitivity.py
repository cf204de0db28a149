"""Sensitivity Q2/Q3: scores, the allocation as a pure function, mixed-bit bundles, the gate."""
import json
import random

import pytest
import torch
import yaml
from safetensors import safe_open

from pipelines.api import build
from pipelines.errors import PipelineError
from pipelines.loader import load_bundle, load_source
from pipelines.methods.sensitivity import MEASUREMENT, MeasureParams, run_measure
from pipelines.models.moss_tts_delay import DEFINITION
from pipelines.api import plan as load_profile
from pipelines.source import CONFIGS
from quantizers.errors import QuantizerError
from quantizers.rtn import RTNConfig, fake_quantize
from quantizers.sensitivity import (SensitivityConfig, allocate, bits_per_weight, estimated_bpw, gram,
                                    output_errors, upgrade_order)

Q = "language_model.layers.{}.{}"


# ---- pure parts ------------------------------------------------------------------------------

def test_score_is_the_relative_output_error_on_the_calibration_activations():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 256, generator=g) * torch.linspace(0.1, 8, 256)  # outlier channels
    w = torch.randn(64, 256, generator=g)
    h = gram(x[0]) + gram(x[1:])  # accumulated over batches as the hooks do
    xs = x.reshape(-1, 256).double()
    scores = output_errors(w, h, (2, 3, 4, 8), 128, False)
    for b in (2, 3, 4, 8):
        dw = (fake_quantize(w, RTNConfig(b, 128, False)) - w).double()
        direct = (xs @ dw.t()).pow(2).sum() / (xs @ w.double().t()).pow(2).sum()
        assert scores[b] == pytest.approx(direct.item(), rel=1e-9)
    assert scores[2] > scores[3] > scores[4] > scores[8] > 0


def _synthetic(n=12, seed=0):
    rnd = random.Random(seed)
    shapes = [(256, 256), (128, 256), (768, 256), (256, 768)]
    numel, scores = {}, {}
    for i in range(n):
        name = f"t{i:02d}"
        o, k = shapes[i % 4]
        numel[name] = o * k
        s2 = rnd.uniform(0.1, 0.6)
        scores[name] = {2: s2, 3: s2 / rnd.uniform(3, 6), 4: s2 / rnd.uniform(15, 30), 8: s2 / 5000}
    return scores, numel


def test_allocation_is_a_pure_function_and_monotone_in_the_budget():
    scores, numel = _synthetic()
    cfg = SensitivityConfig(base_bits=2, protect_bits=[4, 8, 16], target_bpw=2.6)
    a1, _ = allocate(scores, numel, cfg, 128)
    shuffled = dict(reversed(list(scores.items())))
    assert allocate(shuffled, dict(reversed(list(numel.items()))), cfg, 128)[0] == a1  # order-free
    prev, prev_bpw = None, 0.0
    for target in (2.140625, 2.3, 2.6, 3.0, 4.0, 6.0, 9.0, 16.0):
        widths, taken = allocate(scores, numel, SensitivityConfig(2, [4, 8, 16], target_bpw=target), 128)
        bpw = estimated_bpw(widths, numel, 128)
        assert prev_bpw <= bpw <= target + 1e-9
        if prev is not None:  # more budget: a superset of protection, no width lowered
            assert all(widths[n] >= prev[n] for n in widths)
        prev, prev_bpw = widths, bpw
    assert set(prev.values()) == {16} and not any(v > 2 for v in allocate(
        scores, numel, SensitivityConfig(2, [4, 8, 16], protect_budget=0.0), 128)[0].values())


def test_allocation_protects_by_damage_per_extra_bit_with_name_ties():
    numel = {"a": 1000, "b": 1000, "c": 1000, "d": 4000}
    scores = {"a": {3: 0.1, 4: 0.05}, "b": {3: 0.4, 4: 0.05}, "c": {3: 0.1, 4: 0.05}, "d": {3: 0.4, 4: 0.05}}
    order = upgrade_order(scores, numel, 3, [4], 128)
    # b gains most per bit; d gains as much in total but costs four times the bits; a/c tie -> by name
    assert [u.tensors for u in order] == [("b",), ("d",), ("a",), ("c",)]
    cost = 1000 * (bits_per_weight(4, 128) - bits_per_weight(3, 128)) / 7000
    widths, _ = allocate(scores, numel, SensitivityConfig(3, [4], protect_budget=cost), 128)
    assert widths == {"a": 3, "b": 4, "c": 3, "d": 3}


def test_fused_groups_share_one_width_at_every_budget():
    """vLLM fuses q/k/v and gate/up into one kernel and refuses mixed widths inside: a group is one unit."""
    scores, numel = _synthetic()
    groups = [("t00", "t01", "t02"), ("t04", "t05")]
    prev = None
    for target in (2.140625, 2.3, 2.6, 3.0, 4.0, 6.0, 9.0, 16.0):
        widths, taken = allocate(scores, numel, SensitivityConfig(2, [4, 8, 16], target_bpw=target), 128, groups)
        for g in groups:
            assert len({widths[n] for n in g}) == 1, (target, {n: widths[n] for n in g})
        assert estimated_bpw(widths, numel, 128) <= target + 1e-9
        if prev is not None:
            assert all(widths[n] >= prev[n] for n in widths)  # still monotone
        prev = widths
    # a group is valued by its members' total damage and cost: the one lone weak member cannot drag it in
    scores = {"q": {3: 0.5, 4: 0.01}, "k": {3: 0.001, 4: 0.0009}, "o": {3: 0.3, 4: 0.01}}
    numel = dict.fromkeys(scores, 1000)
    order = upgrade_order(scores, numel, 3, [4], 128, [("q", "k")])
    assert [u.tensors for u in order] == [("o",), ("k", "q")]
    assert allocate(scores, numel, SensitivityConfig(3, [4], protect_budget=0.25), 128, [("k", "q")])[0] == \
        allocate(scores, numel, SensitivityConfig(3, [4], protect_budget=0.25), 128, [("q", "k")])[0]  # order-free
    with pytest.raises(QuantizerError, match="'x' has no measured score|x has no measured score"):
        allocate(scores, numel, SensitivityConfig(3, [4], protect_budget=0.1), 128, [("q", "x")])


def test_unreachable_targets_and_unknown_widths_are_refused():
    scores, numel = _synthetic()
    for cfg, text in ((SensitivityConfig(3, [4, 8], target_bpw=3.0), "below 3.1484"),
                      (SensitivityConfig(2, [4, 8], target_bpw=9.0), "above 8.1875"),
                      (SensitivityConfig(2, [4], protect_budget=2.5), "above 4.1562")):
        with pytest.raises(QuantizerError, match=text) as e:
            allocate(scores, numel, cfg, 128)
        assert "\n" not in str(e.value)
    for kw, text in (({"protect_bits": [5]}, "unknown width 5"), ({"protect_bits": [3]}, "not above"),
                     ({"base_bits": 4}, "must be 2 or 3"), ({"target_bpw": 3.5, "protect_budget": 0.1}, "exactly one")):
        cfg = SensitivityConfig(**{"target_bpw": 3.5, **kw})
        with pytest.raises(ValueError, match=text):
            cfg.validate()


# ---- profiles and bundles on the tiny fixture --------------------------------------------------

def _variant(tmp_path, base, name, stages):
    """A copy of a shipped profile with some stage parameters replaced."""
    data = yaml.safe_load((CONFIGS / "profiles" / f"{base}.yaml").read_text())
    data["name"] = name
    for stage, params in stages.items():
        data["stages"][stage] = {**data["stages"][stage], **params}
        for model in data.get("models", {}).values():
            if stage in model:
                model[stage] = {**model[stage], **{k: v for k, v in params.items() if k in model[stage]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("sens")
    return {"cache_root": root / "cache", "bundle_root": root / "bundles", "tmp": root}


def _build(profile, roots):
    return build(profile, "tiny", cache_root=roots["cache_root"], bundle_root=roots["bundle_root"] / profile.split("/")[-1])


def _manifest(ctx):
    return json.loads((ctx.bundle / "manifest.json").read_text())


@pytest.fixture(scope="module")
def q3(roots):
    return _build("sens-q3", roots)


@pytest.fixture(scope="module")
def q2(roots):
    return _build("sens-q2", roots)


def test_sens_q3_bundle_is_mixed_bit_auto_round_with_the_allocation_recorded(q3, tiny_path):
    m = _manifest(q3)
    alloc = m["method_details"]["allocation"]
    assert m["method_details"]["nominal_bits"] == 3
    assert all(c["passed"] for c in m["gate"]["checks"] if not c["metric"].startswith("free."))
    assert MEASUREMENT in m["files"] and m["method_details"]["measurement"]["sha256"] == m["files"][MEASUREMENT]["sha256"]
    qc = json.loads((q3.bundle / "config.json").read_text())["quantization_config"]
    # symmetric: the grid auto-round's CPU kernels and vLLM's Marlin (4/8-bit) run; asym 3-bit loads as placeholders
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"]) == ("auto-round", 3, 128, True)
    for block in range(4):  # vLLM's fused qkv_proj / gate_up_proj need one width per group
        for group in DEFINITION.fused_groups:
            widths = {alloc["tensors"][f"language_model.layers.{block}.{m}"]["bits"] for m in group}
            assert len(widths) == 1, (block, group, widths)
    bpw = m["bits_per_weight"]
    # the allocation's own estimate is exactly what the bundle writer counts on disk for the linears
    assert alloc["estimated_backbone_bpw"] == pytest.approx(bpw["components"]["backbone_linears"]["bpw"], abs=1e-5)
    assert alloc["base_backbone_bpw"] < alloc["estimated_backbone_bpw"] <= alloc["target_backbone_bpw"]
    assert bpw["effective"] > alloc["estimated_backbone_bpw"] > 3  # nominal 3 is neither
    protected = {n: t for n, t in alloc["tensors"].items() if t["bits"] != 3}
    assert protected and all("reason" in t and "per extra bit" in t["reason"] for t in protected.values())
    with safe_open(q3.bundle / "model.safetensors", "pt") as f:
        for name, t in alloc["tensors"].items():
            assert qc.get("extra_config", {}).get(name, {}).get("bits", 3) == t["bits"]
            assert m["tensors"][name + ".weight"]["bits"] == t["bits"]
            if t["bits"] < 16:  # packed rows = input width * bits / 32
                in_f = f.get_slice(name + ".scales").get_shape()[0] * 128
                assert f.get_slice(name + ".qweight").get_shape()[0] == in_f * t["bits"] // 32
    # the project's loader reads the per-layer widths back
    src, q = load_source(tiny_path, torch.float32), load_bundle(q3.bundle, torch.float32)
    for name, t in alloc["tensors"].items():
        w, wq = src.get_parameter(name + ".weight"), q.get_parameter(name + ".weight")
        ref = w if t["bits"] == 16 else fake_quantize(w, RTNConfig(t["bits"], 128, True))
        assert torch.allclose(wq, ref, atol=1e-6)


def test_gate_verdicts_are_recorded_and_a_rejected_build_exits_3(q2, q3, roots, monkeypatch, capsys):
    for ctx in (q2, q3):
        m = _manifest(ctx)
        checks = m["gate"]["checks"]
        assert {c["metric"] for c in checks} >= {"kl_audio_mean", "kl_audio_max", "top1_audio_mean", "kl_text"}
        for c in checks:
            assert c["value"] == {**m["evaluation"]["metrics"], **m["free_running"]["metrics"]}[c["metric"]]
        assert m["status"] == ("accepted" if all(c["passed"] for c in checks) else "rejected")
    m2 = _manifest(q2)
    assert m2["status"] == "rejected" and m2["method_details"]["nominal_bits"] == 2
    # The CLI still builds it, prints `bundle:` last and exits with the gate's code.
    import pipelines.api
    import pipelines.export
    from pipelines.cli import main

    monkeypatch.setattr(pipelines.api, "default_cache_root", lambda: roots["cache_root"])
    monkeypatch.setattr(pipelines.export, "ARTIFACTS", roots["tmp"] / "cli")
    with pytest.raises(SystemExit) as e:
        main(["quantize", "sens-q2", "--model", "tiny"])
    assert e.value.code == 3
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1].startswith("bundle: ") and "rejected by the quality gate" in err


def test_sens_q3_beats_uniform_rtn3_at_comparable_width(q3, rtn4_build, roots):
    rtn3 = _build(_variant(roots["tmp"], "rtn4", "rtn3", {"quantize": {"bits": 3}}), roots)
    pts = {}
    for label, ctx in (("rtn3", rtn3), ("sens", q3), ("rtn4", rtn4_build)):
        m = _manifest(ctx)
        pts[label] = (m["bits_per_weight"]["components"]["backbone_linears"]["bpw"], m["evaluation"]["metrics"])
    (b3, e3), (bs, es), (b4, e4) = pts["rtn3"], pts["sens"], pts["rtn4"]
    assert b3 < bs < b3 + 0.4 < b4
    assert es["kl_audio_mean"] < e3["kl_audio_mean"] and es["top1_audio_mean"] > e3["top1_audio_mean"]
    # Not just the extra bits: below the straight line from uniform 3-bit to uniform 4-bit.
    line = e3["kl_audio_mean"] + (e4["kl_audio_mean"] - e3["kl_audio_mean"]) * (bs - b3) / (b4 - b3)
    assert es["kl_audio_mean"] < line


def test_scores_are_deterministic_and_a_measurement_file_is_reused(q3, roots, tmp_path):
    first = (q3.dirs["measure"] / MEASUREMENT).read_bytes()
    again = tmp_path / "again"
    again.mkdir()
    run_measure(q3, q3.profile.stages["measure"], again)  # measured afresh, same inputs
    assert (again / MEASUREMENT).read_bytes() == first
    assert (q3.bundle / MEASUREMENT).read_bytes() == first
    reuse = _build(_variant(roots["tmp"], "sens-q3", "sens-q3-reuse", {"measure": {"measurement": str(again / MEASUREMENT)}}), roots)
    assert reuse.results["measure"]["reused"] is True
    assert (reuse.bundle / MEASUREMENT).read_bytes() == first
    assert _manifest(reuse)["method_details"]["allocation"] == _manifest(q3)["method_details"]["allocation"]


def _refused(profile, roots, match):
    before = sorted(p.relative_to(roots["tmp"]) for p in roots["tmp"].rglob("*"))
    with pytest.raises(PipelineError, match=match) as e:
        _build(profile, roots)
    assert "\n" not in str(e.value)
    after = sorted(p.relative_to(roots["tmp"]) for p in roots["tmp"].rglob("*"))
    new = [p for p in after if p not in before and p.suffix != ".yaml"]
    assert not new or all("calibrate" in p.parts or "measure" in p.parts for p in new), new  # no bundle, no quantize


def test_a_measurement_from_another_calibration_or_source_is_refused(q3, roots):
    data = json.loads((q3.dirs["measure"] / MEASUREMENT).read_text())
    for key, field, text in (("calibration", "sha256", "measured on calibration"),
                             ("source", "pins_digest", "measured on source")):
        bad = json.loads(json.dumps(data))
        bad[key][field] = "0" * 64
        f = roots["tmp"] / f"bad-{key}.json"
        f.write_text(json.dumps(bad))
        prof = _variant(roots["tmp"], "sens-q3", f"bad-{key}", {"measure": {"measurement": str(f)}})
        _refused(prof, roots, text)
        assert not (roots["bundle_root"] / f"bad-{key}.yaml").exists()


def test_bad_targets_and_widths_are_refused_with_one_line(q3, roots):
    _refused(_variant(roots["tmp"], "sens-q3", "too-low", {"quantize": {"target_bpw": 3.0}}), roots, "below 3.1484")
    _refused(_variant(roots["tmp"], "sens-q3", "too-high", {"quantize": {"protect_bits": [4], "target_bpw": 5.0}}),
             roots, "above 4.1562")
    for stages, text in (({"measure": {"candidate_bits": [2, 3, 5]}}, "measure.candidate_bits: unknown width 5"),
                         ({"quantize": {"protect_bits": [4, 6]}}, "quantize.protect_bits: unknown width 6")):
        with pytest.raises(PipelineError, match=text):
            load_profile(_variant(roots["tmp"], "sens-q3", "bad-width", stages), "tiny")
    # a width the profile protects with but the measurement did not score
    _refused(_variant(roots["tmp"], "sens-q3", "unmeasured", {"measure": {"candidate_bits": [3, 4]}}), roots,
             "width 8 was not measured")


def test_bf16_protection_is_stored_plain_and_marked_like_auto_round(roots, tiny_path):
    ctx = _build(_variant(roots["tmp"], "sens-q3", "sens-bf16", {"quantize": {"protect_bits": [16], "target_bpw": 3.8}}), roots)
    m = _manifest(ctx)
    qc = json.loads((ctx.bundle / "config.json").read_text())["quantization_config"]
    kept = [n for n, t in m["method_details"]["allocation"]["tensors"].items() if t["bits"] == 16]
    assert kept
    src = load_source(tiny_path, torch.float32)
    q = load_bundle(ctx.bundle, torch.float32)
    with safe_open(ctx.bundle / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for n in kept:
        assert qc["extra_config"][n] == {"bits": 16, "data_type": "fp"}
        assert n + ".weight" in keys and n + ".qweight" not in keys and n + ".weight" in m["protected"]
        assert m["tensors"][n + ".weight"]["reason"].startswith("score ")
        assert torch.equal(q.get_parameter(n + ".weight"), src.get_parameter(n + ".weight"))
    alloc = m["method_details"]["allocation"]
    assert alloc["estimated_backbone_bpw"] == pytest.approx(m["bits_per_weight"]["components"]["backbone_linears"]["bpw"], abs=1e-5)


def test_a_pinned_measurement_hash_is_checked(tmp_path):
    f = tmp_path / "m.json"
    f.write_text("{}")
    p = MeasureParams(measurement=str(f))
    p.validate()  # filled in from the file: the stage cache follows the content
    assert p.measurement_sha256 and len(p.measurement_sha256) == 64
    with pytest.raises(ValueError, match="measurement_sha256: .* expected 000000000000"):
        MeasureParams(measurement=str(f), measurement_sha256="0" * 64).validate()
    with pytest.raises(ValueError, match="without a measurement file"):
        MeasureParams(measurement_sha256="0" * 64).validate()
