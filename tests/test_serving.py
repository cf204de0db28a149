"""The CPU cells of the serving matrix (README): each shipped generator profile's exported backbone
loaded by transformers with the quantizer integration it uses for that format, every weight from
the checkpoint (no placeholder backend), logits against the project's own loader."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from pipelines import calibration
from pipelines.backbone_export import export_backbone
from pipelines.checkpoint import Checkpoint
from pipelines.errors import PipelineError
from pipelines.loader import load_bundle
from pipelines.profile import profile_path

AUTO_ROUND = ["rtn4", "autoround-q3", "sens-q3", "sens-q2"]
# max relative logit error and min top-1 agreement per load dtype. The reference is our loader in
# float32: fp16/fp32 loads differ only by kernel rounding; bf16 activations carry ~0.4% on their own.
DTYPES = {"float32": (2e-3, 0.98), "float16": (3e-3, 0.98), "bfloat16": (2e-2, 0.9)}
# auto-round-lib's ARK kernel (`compute_dtype="auto"`) quantizes the activations to int8 on CPUs with
# VNNI/AMX int8 units (measured here: 1.4-1.6% relative logit error in float32, where AVX2 gives 4e-7):
# the bound of a W4A8 kernel, still far from the ~100% of placeholder weights.
INT8_ACTIVATIONS = (3e-2, 0.95)


def _int8_activations(model) -> bool:
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    ark = any(type(m).__module__.startswith("auto_round_kernel") for m in model.modules())
    return ark and bool({"avx512_vnni", "amx_int8", "avx_vnni"} & set(flags))


@pytest.fixture(scope="module")
def exported(shipped, tmp_path_factory):
    """profile -> (backbone folder, our float32 logits, the inputs_embeds), each exported once."""
    out = {}

    def get(profile):
        if profile not in out:
            bundle = shipped(profile).bundle
            dest = export_backbone(bundle, tmp_path_factory.mktemp(profile) / "backbone")
            ours = load_bundle(bundle, dtype=torch.float32)
            ids = calibration.build("moss-heldout-v1", Checkpoint(bundle).config(), 2, 64).ids
            with torch.no_grad():
                x = ours.embed(ids)
                logits = ours.lm_heads[0](ours.language_model(inputs_embeds=x, use_cache=False).last_hidden_state)
            out[profile] = (dest, logits, x)
        return out[profile]

    return get


def load_hf(dest, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(dest, dtype=dtype, device_map="cpu", output_loading_info=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("profile", AUTO_ROUND)
def test_transformers_loads_each_auto_round_backbone_with_real_weights(exported, profile, dtype):
    dest, ours, x = exported(profile)
    hf, info = load_hf(dest, getattr(torch, dtype))
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # a placeholder backend misses weights
    for block in hf.model.layers:
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
            layer = block.get_submodule(m)
            assert hasattr(layer, "qweight") or isinstance(layer, torch.nn.Linear), type(layer)
    with torch.no_grad():
        got = hf(inputs_embeds=x.to(hf.dtype), use_cache=False).logits.float()
    max_rel, min_top1 = INT8_ACTIVATIONS if _int8_activations(hf) and dtype != "bfloat16" else DTYPES[dtype]
    rel = ((got - ours).norm() / ours.norm()).item()
    top1 = (got.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert rel < max_rel and top1 >= min_top1, (rel, top1)


def test_awq_backbone_names_its_head_and_transformers_refuses_it_loudly_without_gptqmodel(shipped, tmp_path, capsys):
    dest = export_backbone(shipped("awq4").bundle, tmp_path / "backbone")
    assert "gptqmodel" in capsys.readouterr().err  # export says what transformers will need
    qc = json.loads((dest / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["lm_head"]  # the exported module's name, not the bundle's lm_heads
    pytest.importorskip("transformers")
    try:
        import gptqmodel  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="gptqmodel"):
            load_hf(dest, torch.float16)
    else:  # pragma: no cover - only where gptqmodel installs (torch >= 2.14.1)
        hf, info = load_hf(dest, torch.float16)
        assert not info["missing_keys"]


def _asym3_profile(tmp_path):
    """Asymmetric 3-bit (RTN), the grid sens-q3 once had: auto-round has no CPU kernel for it."""
    data = yaml.safe_load(profile_path("rtn4").read_text())
    data["name"], data["stages"]["quantize"]["bits"] = "rtn3-asym", 3
    path = tmp_path / "rtn3-asym.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_grid_without_a_kernel_is_refused_and_would_have_loaded_placeholders(tmp_path, capsys):
    from pipelines.api import build

    ctx = build(str(_asym3_profile(tmp_path)), "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "b")
    assert "no CPU kernel" in capsys.readouterr().err  # the bundle's own export already said it
    with pytest.raises(PipelineError, match=r"asymmetric 3-bit .*no CPU kernel.*placeholder.*nothing written") as e:
        export_backbone(ctx.bundle, tmp_path / "backbone")
    assert "\n" not in str(e.value) and not (tmp_path / "backbone").exists()

    # what the refusal prevents: the same folder written anyway loads with freshly initialised weights
    import pipelines.backbone_export as be

    real = be.serving.gaps
    be.serving.gaps = lambda qc: [g for g in real(qc) if not g.refuse]
    try:
        dest = export_backbone(ctx.bundle, tmp_path / "forced")
    finally:
        be.serving.gaps = real
    _, info = load_hf(dest, torch.float16)
    assert any(k.endswith("_proj.weight") for k in info["missing_keys"])  # the placeholder the test above rejects
    shutil.rmtree(dest)


def test_export_names_what_the_runtimes_lack(shipped, capsys):
    from pipelines import serving

    qc = json.loads((shipped("rtn4").bundle / "config.json").read_text())["quantization_config"]
    said = [str(g) for g in serving.gaps(qc)]
    assert any("auto-round-lib" in s and "placeholder" in s for s in said)  # asym 4-bit CPU kernel
    assert any(s.startswith("vLLM") and "Marlin" in s for s in said)  # asym: no Marlin
    sym4 = {**qc, "sym": True}
    assert not [g for g in serving.gaps(sym4) if g.runtime == "vLLM"]  # symmetric 4-bit: Marlin
    mixed = {**sym4, "extra_config": {"language_model.layers.0.mlp.down_proj": {"bits": 3},
                                      "language_model.layers.0.mlp.up_proj": {"bits": 16, "data_type": "fp"}}}
    (gap,) = serving.gaps(mixed)
    assert "1 layers, e.g. language_model.layers.0.mlp.down_proj" in str(gap) and "gibberish" in str(gap)


@pytest.mark.parametrize("profile", AUTO_ROUND)
def test_the_whole_generator_runs_with_the_transformers_backbone(exported, shipped, profile):
    """What a MOSS user runs beside transformers (README snippet): the exported backbone, the bundle's
    BF16 audio embeddings and heads as plain modules, the delay-pattern step of pipelines.generate.
    Greedy codes equal our loader's, frame by frame. Where the CPU kernel quantizes activations to int8,
    free-running greedy codes part at the first near-tie and never meet again, so there each step's
    choice of every head is compared on our loader's sequence (teacher-forced): at least 90% agree."""
    from pipelines.generate import generate, special_ids

    dest, _, _ = exported(profile)
    bundle = shipped(profile).bundle
    ours = load_bundle(bundle, dtype=torch.float32)
    hybrid = load_bundle(bundle, dtype=torch.float32)
    hf = load_hf(dest, torch.float32)[0]
    hybrid.language_model = hf.model  # embed_tokens + blocks + norm
    ids = special_ids(ours.config.raw)
    prompt = torch.full((6, 1 + ours.config.n_vq), ours.config.audio_pad_code)
    prompt[:, 0] = torch.tensor([ids["im_start_token_id"], 72, 105, 33, ids["im_end_token_id"], ids["audio_start_token_id"]])
    want, got = generate(ours, prompt, 40, ids), generate(hybrid, prompt, 40, ids)
    assert len(want) >= 20 and len(got) >= 20
    if not _int8_activations(hf):
        assert torch.equal(got, want)
        return
    seq = torch.cat([prompt, want])[None]

    def choices(model):
        with torch.no_grad():
            h = model.language_model(inputs_embeds=model.embed(seq), use_cache=False).last_hidden_state
            return torch.stack([head.argmax(-1) for head in model.heads(h)], -1)[0, len(prompt) - 1:-1]

    assert (choices(hybrid) == choices(ours)).float().mean().item() >= 0.9
