"""Teacher-forced fidelity on cases with known answers, and the optional scorer plug-in point."""
import json
import math
import sys
import types
import zlib

import pytest
import torch
import yaml

from pipelines.calibration import build as build_set
from pipelines.checkpoint import Checkpoint
from pipelines.api import build
from pipelines.errors import PipelineError
from pipelines.evaluate import EvaluateParams, _kl_top1, compare
from pipelines.models.moss_tts_delay import audio_positions
from pipelines.fixtures import write_fixture
from pipelines.profile import build_params
from pipelines.scorers import ExactMatch, load_scorers, run_scorers
from quantizers.rtn import RTNConfig, fake_quantize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_fixture("tiny", tmp_path_factory.mktemp("src") / "tiny")
    ckpt = Checkpoint(path)
    ids = build_set("moss-heldout-v1", ckpt.config(), 2, 48, path).ids
    return path, ckpt, ids


def is_block_linear(name, block=None):
    prefix = "language_model.layers." + ("" if block is None else f"{block}.")
    return name.startswith(prefix) and name.endswith("proj.weight")


def perturbed(ckpt, scale, which=is_block_linear):
    """Source weights plus Gaussian noise of `scale` x each tensor's std on the chosen tensors
    (seeded by name, so every call sees the same noise)."""

    def get(name):
        t = ckpt.get(name)
        if not which(name):
            return t
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return (t.float() + scale * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)

    return get


def test_identical_models_give_zero_kl_and_full_agreement(tiny):
    _, ckpt, ids = tiny
    m = compare(ckpt.config(), ckpt.get, ckpt.get, ids)
    n_vq = ckpt.config()["n_vq"]
    assert m["kl_text"] == 0.0 and m["top1_text"] == 1.0
    assert m["kl_audio"] == [0.0] * n_vq and m["top1_audio"] == [1.0] * n_vq
    assert m["kl_audio_mean"] == m["kl_audio_max"] == 0.0
    assert m["top1_audio_mean"] == m["top1_audio_min"] == 1.0
    assert m["block_rel_error"] == [0.0] * ckpt.config()["language_config"]["num_hidden_layers"]
    assert m["final_rel_error"] == 0.0


def test_kl_and_top1_match_hand_computation():
    ninf = float("-inf")
    # position 0: p = (1/2, 1/2, 0), q = (1/4, 3/4, 0); position 1 is masked out.
    ref = torch.tensor([[[0.0, 0.0, ninf], [5.0, 0.0, 0.0]]])
    q = torch.tensor([[[math.log(0.25), math.log(0.75), ninf], [0.0, 5.0, 0.0]]])
    kl, agree, n = _kl_top1(ref, q, torch.tensor([[True, False]]))
    assert n == 1
    assert kl == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-6)
    assert agree == 0.0  # argmax 0 (tie broken to the first) vs argmax 1
    kl, agree, n = _kl_top1(ref, q, torch.tensor([[True, True]]))
    assert n == 2 and agree == 0.0 and kl > 0.5 * math.log(2) + 0.5 * math.log(2 / 3) + 1.0


def test_perturbed_model_is_worse_and_more_noise_is_monotonically_worse(tiny):
    _, ckpt, ids = tiny
    runs = [compare(ckpt.config(), ckpt.get, perturbed(ckpt, s), ids) for s in (0.03, 0.1, 0.3)]
    for key in ("kl_text", "kl_audio_mean", "kl_audio_max", "final_rel_error"):
        values = [r[key] for r in runs]
        assert 0 < values[0] < values[1] < values[2], (key, values)
    for key in ("top1_text", "top1_audio_mean"):
        values = [r[key] for r in runs]
        assert 1 > values[0] > values[1] > values[2], (key, values)
    for r in runs:  # errors accumulate through the stack
        assert all(e > 0 for e in r["block_rel_error"])
        assert r["block_rel_error"][-1] > r["block_rel_error"][0]


def test_fewer_rtn_bits_give_worse_fidelity(tiny):
    _, ckpt, ids = tiny

    def rtn(bits):
        return lambda n: fake_quantize(ckpt.get(n), RTNConfig(bits, 128)) if is_block_linear(n) else ckpt.get(n)

    kl = [compare(ckpt.config(), ckpt.get, rtn(b), ids)["kl_audio_mean"] for b in (8, 4, 2)]
    assert 0 < kl[0] < kl[1] < kl[2], kl


def test_error_is_located_where_the_perturbation_is(tiny):
    _, ckpt, ids = tiny
    cfg = ckpt.config()
    m = compare(cfg, ckpt.get, perturbed(ckpt, 0.1, lambda n: is_block_linear(n, 2)), ids)
    assert m["block_rel_error"][:2] == [0.0, 0.0] and all(e > 0 for e in m["block_rel_error"][2:])
    # one audio head (lm_heads.5 = codebook 4): only that codebook moves, the backbone is exact
    m = compare(cfg, ckpt.get, perturbed(ckpt, 0.5, lambda n: n == "lm_heads.5.weight"), ids)
    assert m["block_rel_error"] == [0.0] * len(m["block_rel_error"])
    assert m["kl_text"] == 0.0 and m["kl_audio"][4] > 0 and m["top1_audio"][4] < 1
    assert [x for i, x in enumerate(m["kl_audio"]) if i != 4] == [0.0] * (cfg["n_vq"] - 1)
    # the text head: text KL only
    m = compare(cfg, ckpt.get, perturbed(ckpt, 0.5, lambda n: n == "lm_heads.0.weight"), ids)
    assert m["kl_text"] > 0 and m["kl_audio_max"] == 0.0


# --------------------------------------------------------------------------- scorers


class TopOneScorer:
    """Recomputes the teacher-forced top-1 agreement from the tokens a scorer is given: equal to
    the stage's own figures only if reference, candidate and context are wired correctly."""

    name = "replay"

    def score(self, reference, candidate, context):
        assert context["modality"] == "generator-tokens" and reference.shape == context["ids"].shape
        mask = context["audio_mask"]
        n_vq = context["config"]["n_vq"]
        audio = [float((reference[..., k][mask] == candidate[..., k][mask]).float().mean()) for k in range(1, n_vq + 1)]
        return {"top1_text": float((reference[..., 0] == candidate[..., 0]).float().mean()),
                "top1_audio_mean": sum(audio) / n_vq, "codec_known": float(context["codec_model"] == "codec-tiny")}


@pytest.fixture
def scorer_module(monkeypatch):
    mod = types.ModuleType("mq_user_scorers")
    mod.TopOneScorer = TopOneScorer
    mod.Nameless = type("Nameless", (), {"score": lambda self, r, c, ctx: {}})
    mod.Broken = type("Broken", (), {"name": "broken", "score": lambda self, r, c, ctx: {"x": float("nan")}})
    monkeypatch.setitem(sys.modules, "mq_user_scorers", mod)
    return mod


def test_scorers_are_loaded_only_when_configured_and_bad_entries_fail_in_one_line(scorer_module):
    assert EvaluateParams().scorers == [] and load_scorers([]) == []
    [s] = load_scorers(["mq_user_scorers:TopOneScorer"])
    assert s.name == "replay"
    with pytest.raises(PipelineError, match=r"evaluate.*scorers: 'nocolon' is not 'package.module:ClassName'"):
        build_params(EvaluateParams, {"scorers": ["nocolon"]}, "p.yaml: stages.evaluate")
    for entry, msg in [("no_such_pkg_xyz.mod:Cls", "cannot import 'no_such_pkg_xyz.mod'"),
                       ("mq_user_scorers:Missing", "has no class 'Missing'"),
                       ("mq_user_scorers:Nameless", "needs a `name`")]:
        with pytest.raises(PipelineError, match=msg) as e:
            load_scorers([entry])
        assert "\n" not in str(e.value)
    with pytest.raises(PipelineError, match="two scorers are named"):
        load_scorers(["mq_user_scorers:TopOneScorer"] * 2)
    with pytest.raises(PipelineError, match="scorer 'broken': figure 'x' is nan"):
        run_scorers(load_scorers(["mq_user_scorers:Broken"]), torch.zeros(1), torch.zeros(1), {})


def test_exact_match_scorer():
    a = torch.tensor([[1, 2, 3, 4]])
    assert run_scorers([ExactMatch()], a, a, {}) == {"exact.match": 1.0}
    assert run_scorers([ExactMatch()], a, torch.tensor([[1, 2, 0, 0]]), {}) == {"exact.match": 0.5}


def test_evaluate_stage_runs_configured_scorers_into_the_manifest_and_gate(tiny, tmp_path, scorer_module):
    path, ckpt, _ = tiny
    profile = tmp_path / "rtn4-scored.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "rtn4-scored", "kind": "generator", "seed": 0,
        "stages": {
            "quantize": {"method": "rtn", "bits": 4, "group_size": 128, "sym": False},
            "evaluate": {"nsamples": 2, "seqlen": 64,
                         "scorers": ["pipelines.scorers:ExactMatch", "mq_user_scorers:TopOneScorer"]},
            "gate": {"min": {"replay.codec_known": 1.0, "exact.match": 0.999}},
            "export": {},
        }}, sort_keys=False))
    ctx = build(str(profile), "tiny", model_path=path, cache_root=tmp_path / "cache", bundle_root=tmp_path / "bundles")
    m = json.loads((ctx.bundle / "manifest.json").read_text())
    metrics = m["evaluation"]["metrics"]
    assert metrics["replay.top1_text"] == pytest.approx(metrics["top1_text"], abs=1e-5)
    assert metrics["replay.top1_audio_mean"] == pytest.approx(metrics["top1_audio_mean"], abs=1e-5)
    assert 0 < metrics["exact.match"] < 1  # a 4-bit model does not pick every token of the source
    assert metrics["replay.codec_known"] == 1.0
    # the gate reads scorer figures like any other: exact.match < 0.999 rejects the bundle
    assert m["status"] == "rejected"
    failed = [c["metric"] for c in m["gate"]["checks"] if not c["passed"]]
    assert failed == ["exact.match"]
    assert m["stages"]["evaluate"]["scorers"] == ["pipelines.scorers:ExactMatch", "mq_user_scorers:TopOneScorer"]


def test_audio_positions_are_the_slot_tokens(tiny):
    _, ckpt, ids = tiny
    mask = audio_positions(ckpt.config(), ids)
    assert mask.shape == ids.shape[:2] and 0 < int(mask.sum()) < mask.numel()
    assert not mask[:, 0].any()  # every sample opens with a text prompt
