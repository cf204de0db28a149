"""Free-running evaluation (issue 18): coupled sampling, the run comparisons, and the gate's
free-running checks rejecting deliberately broken models that teacher forcing would pass."""
import math

import pytest
import torch
import yaml

from pipelines import freerun
from pipelines.checkpoint import Checkpoint
from pipelines.freerun import FreeRunParams, compare_runs, free_run, gated, gumbel, loops
from pipelines.generate import Run, generate_batch, special_ids
from pipelines.source import CONFIGS

N_VQ, PAD = 4, 16


def test_loops_finds_a_held_cycle_and_nothing_in_varied_codes():
    varied = torch.arange(60 * N_VQ).reshape(60, N_VQ) % 13
    assert not loops(varied)
    cycle = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    assert loops(torch.cat([varied[:20], cycle.repeat(12, 1)]))  # period 3 for 36 frames
    assert not loops(torch.cat([cycle.repeat(12, 1), varied[:20]]))  # a loop that was left is not a runaway


def _rows(codes):
    rows = torch.full((len(codes), 1 + N_VQ), PAD)
    rows[:, 0] = 5
    rows[:, 1:] = torch.tensor(codes)
    return rows


def test_compare_runs_first_divergence_agreement_and_runaway():
    ref = Run(_rows([[1, PAD, PAD, PAD], [2, 3, PAD, PAD], [4, 5, 6, PAD], [7, 8, 9, 10]]), True, 0)
    cand = Run(_rows([[1, PAD, PAD, PAD], [2, 3, PAD, PAD], [4, 0, 6, PAD], [0, 8, 9, 10], [1, 1, 1, 1], [2, 2, 2, 2]]),
               False, 3)
    c = compare_runs(ref, cand, N_VQ, PAD)
    assert c["first_divergence"] == 2
    # agreement only where the reference emitted a code: codebook 0 3/4, codebook 1 2/3, codebooks 2, 3 all
    assert c["agreement"] == pytest.approx([0.75, 2 / 3, 1.0, 1.0])
    assert c["row_agreement"] == pytest.approx([1.0, 1.0, 2 / 3, 0.75])  # the curve's points: due codes per row
    assert c["length_ratio"] == 1.5 and c["runaway"] and c["ended"] == [True, False]
    assert c["overrides_per_row"] == [0.0, 0.5]
    assert not compare_runs(ref, ref, N_VQ, PAD)["runaway"]


def _mode(agree, lengths, runaways, mel):
    return {"prompts": len(lengths), "code_agreement": agree, "length_ratios": lengths, "runaways": runaways,
            "log_mel_per_prompt": mel}


def test_gated_figures_are_pooled_ratios_to_the_reroll():
    sets = {"a": {"greedy": _mode(0.5, [1.0, 1.0], 1, [None, None]),
                  "sampled": _mode(0.8, [2.0, 0.5], 1, [1.0, None]),
                  "resample": _mode(0.6, [1.0, 4.0], 0, [2.0, 3.0])},
            "b": {"greedy": _mode(0.5, [1.0, 1.0], 0, [None, None]),
                  "sampled": _mode(0.6, [1.0, 1.0], 0, [3.0, 3.0]),
                  "resample": _mode(0.6, [1.0, 1.0], 1, [None, 1.0])}}
    g = gated(sets)
    assert g["free.prompts"] == 4
    assert g["free.code_disagreement_ratio"] == pytest.approx((1 - 0.7) / (1 - 0.6))
    assert g["free.length_ratio"] == pytest.approx(1.0)  # 2 x 0.5 x 1 x 1
    assert g["free.length_dev_ratio"] == pytest.approx(2 * math.log(2) / math.log(4))
    noise = math.sqrt(math.log(4) ** 2 / 4)  # the reroll's per-prompt spread; the candidate's mean shift is 0
    assert g["free.length_shift"] == 0.0 and noise > 0
    for s in sets.values():  # every utterance 4x shorter where a reroll keeps every length: all of it counts
        s["sampled"]["length_ratios"], s["resample"]["length_ratios"] = [0.25, 0.25], [1.0, 1.0]
    assert gated(sets)["free.length_shift"] == pytest.approx(math.log(4))
    sets["a"]["resample"]["length_ratios"] = [4.0, 0.25]  # a noisy reroll explains part of it
    assert gated(sets)["free.length_shift"] == pytest.approx(math.log(4) - 2 * math.sqrt(2 * math.log(4) ** 2 / 4) / 2)
    assert g["free.runaway_excess"] == pytest.approx((1 + max(0, 1 - 1)) / 4)  # greedy 1, sampled 1 - reroll 1
    assert g["free.log_mel_ratio"] == pytest.approx((1.0 + 3.0) / (2.0 + 1.0))  # prompts comparable in both


def _models(tiny_path, **replace):
    from pipelines.models.moss_tts_delay import MossTTSDelayConfig, build_empty, load_state

    ck = Checkpoint(tiny_path)
    cfg = MossTTSDelayConfig.from_dict(ck.config())
    get = lambda name: replace[name](ck.get(name)) if name in replace else ck.get(name)  # noqa: E731
    return ck, cfg, load_state(build_empty(cfg), get, dtype=torch.float32)


def test_coupled_noise_is_portable_and_couples_samples(tiny_path):
    ck, cfg, model = _models(tiny_path)
    ids = special_ids(ck.config())
    prompts, _ = freerun.prompts_of("moss-heldout-v2", ck.config(), 2, 25, tiny_path)
    vocab, audio = cfg.language_config["vocab_size"], cfg.audio_pad_code + 1
    a, b = gumbel("s", 2, vocab, N_VQ, 5)(3), gumbel("s", 2, vocab, N_VQ, 5)(3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], gumbel("t", 2, vocab, N_VQ, 5)(3)[0])
    runs = [generate_batch(model, prompts, 60, ids, noise=gumbel(name, 2, vocab, cfg.n_vq, audio))
            for name in ("x", "x", "y")]
    assert all(torch.equal(r.rows, s.rows) for r, s in zip(runs[0], runs[1]))  # same model, same noise: same draws
    assert any(not torch.equal(r.rows, s.rows) for r, s in zip(runs[0], runs[2]))  # other noise: other draws
    # batched and left-padded equals one prompt at a time
    alone = generate_batch(model, prompts[1:], 60, ids, noise=lambda t: tuple(g[1:] for g in gumbel("x", 2, vocab, cfg.n_vq, audio)(t)))
    assert torch.equal(alone[0].rows, runs[0][1].rows)


class SampleCount:
    """A scorer on the decoded audio: how many samples the candidate's continuations hold beside BF16's."""

    name = "count"

    def score(self, reference, candidate, context):
        assert context["modality"] == "decoded-audio" and len(reference) == len(candidate)
        return {"ratio": sum(len(c) for c in candidate) / max(1, sum(len(r) for r in reference))}


def _bounds():
    gate = yaml.safe_load((CONFIGS / "profiles" / "rtn4.yaml").read_text())["stages"]["gate"]
    return {k: v for k, v in gate["max"].items() if k.startswith("free.")}, \
        {k: v for k, v in gate["min"].items() if k.startswith("free.")}


def _failed(figures):
    hi, lo = _bounds()
    return sorted({k for k, v in hi.items() if figures[k] > v} | {k for k, v in lo.items() if figures[k] < v})


@pytest.fixture(scope="module")
def run_against_bf16(tiny_path):
    from pipelines.models.moss_audio_tokenizer import source_decoder
    from pipelines.source import load_model_spec, resolve_path

    codec = source_decoder(Checkpoint(resolve_path(load_model_spec("codec-tiny"))))
    ck, _, ref = _models(tiny_path)
    params = FreeRunParams(sets=["moss-heldout-v1", "moss-heldout-v2"], prompts=4, max_frames=400, wavs=0)

    def run(**replace):
        cand = _models(tiny_path, **replace)[2]
        sets, _ = free_run({"ref": ref, "cand": cand}, codec, ck.config(), params, 0, tiny_path, None,
                           scorers=[SampleCount()])
        return gated(sets)

    return run


def test_bf16_against_itself_passes_with_zero_deviation(run_against_bf16):
    g = run_against_bf16()
    assert g["free.code_disagreement_ratio"] == 0 and g["free.length_ratio"] == 1 and g["free.runaway_excess"] == 0
    assert g["free.count.ratio"] == 1.0  # scorers see the decoded continuations, averaged over the sets
    assert _failed(g) == []


def test_a_zeroed_text_head_is_rejected_by_the_free_running_checks(run_against_bf16):
    """The text head only decides when the audio ends: teacher-forced audio KL cannot see it."""
    g = run_against_bf16(**{"lm_heads.0.weight": torch.zeros_like})
    assert "free.length_shift" in _failed(g), g
    assert g["free.count.ratio"] < 0.9  # it ends early, so it also says less


def test_two_bit_rtn_everywhere_is_rejected_by_the_free_running_checks(run_against_bf16, tiny_path):
    from quantizers.rtn import RTNConfig, fake_quantize

    rtn2 = lambda w: fake_quantize(w.float(), RTNConfig(2, 128, True))  # noqa: E731
    names = [n for n in Checkpoint(tiny_path).keys() if ".layers." in n and n.endswith("proj.weight")]
    g = run_against_bf16(**{n: rtn2 for n in names})
    assert _failed(g), g
