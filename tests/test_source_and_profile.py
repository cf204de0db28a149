import shutil
import subprocess
import sys

import pytest
import yaml

from pipelines.errors import PipelineError
from pipelines.api import plan as load_profile
from pipelines.source import load_model_spec, pin, resolve_path, verify


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_verify_names_the_corrupted_and_the_missing_file(tiny_path, tmp_path):
    spec = load_model_spec("tiny")
    bad = _copy(tiny_path, tmp_path / "snap")
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match=rf"{shard.name}: sha256 .* does not match the pin"):
        verify(spec, bad)
    shard.unlink()
    with pytest.raises(PipelineError, match=rf"{shard.name}: missing"):
        verify(spec, bad)


def test_unpinned_and_unfound_models_say_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("MOSSQUANT_MODEL_PATH_MOSS_TTS", raising=False)
    spec = load_model_spec("moss-tts")
    with pytest.raises(PipelineError) as e:
        resolve_path(spec)
    msg = str(e.value)
    assert "MOSSQUANT_MODEL_PATH_MOSS_TTS" in msg and "MODEL=tiny" in msg and "\n" not in msg
    # found through the HF cache layout, then refused because it is not pinned
    snap = tmp_path / "hf" / "hub" / "models--OpenMOSS-Team--MOSS-TTS" / "snapshots" / "main"
    snap.mkdir(parents=True)
    assert resolve_path(spec) == snap
    with pytest.raises(PipelineError, match="mossquant pin moss-tts"):
        verify(spec, snap)


def test_pin_writes_every_sha256_like_a_lock_file(tiny_path, tmp_path, monkeypatch):
    import pipelines.source as source

    configs = tmp_path / "configs"
    shutil.copytree(source.CONFIGS, configs)
    monkeypatch.setattr(source, "CONFIGS", configs)
    (configs / "models" / "moss-tts.yaml").write_text(
        (configs / "models" / "moss-tts.yaml").read_text().replace("files: {}", "files: {}"))
    pin("moss-tts", tiny_path)  # any snapshot folder: pins are computed, never downloaded
    data = yaml.safe_load((configs / "models" / "moss-tts.yaml").read_text())
    assert data["files"] == yaml.safe_load((source.ROOT / "configs/models/tiny.yaml").read_text())["files"]
    assert (configs / "models" / "moss-tts.yaml").read_text().startswith("# The real MOSS-TTS")
    monkeypatch.setenv("MOSSQUANT_MODEL_PATH_MOSS_TTS", str(tiny_path))
    spec = load_model_spec("moss-tts")
    assert verify(spec, resolve_path(spec)) == data["files"]


@pytest.mark.parametrize("edit, message", [
    ({"stages": {"quantize": {"method": "rtn", "bits": 5}}}, r"stages.quantize.bits: 5 is not supported \(allowed: \[2, 3, 4, 8\]\)"),
    ({"stages": {"quantize": {"method": "rtn", "group_size": 100}}}, r"group_size: 100 is not supported"),
    ({"stages": {"quantize": {"method": "rtn", "bitz": 4}}}, r"stages.quantize: unknown key 'bitz' \(allowed: bits, group_size, sym\)"),
    ({"stages": {"quantize": {"method": "rtn", "sym": "no"}}}, r"stages.quantize.sym: expected bool, got 'no'"),
    ({"stages": {"quantize": {"method": "gptq9"}}}, r"stages.quantize.method: unknown method 'gptq9'"),
    ({"stages": {"calibrate": {"nsamples": "many"}}}, r"stages.calibrate.nsamples: expected int"),
    ({"stages": {"shuffle": {}}}, r"stages.shuffle: unknown stage \(allowed: "),
    ({"stages": {"evalute": {}}, "models": {"tiny": {"evaluate": {"nsamples": 2}}}},
     r"stages.evalute: unknown stage \(did you mean 'evaluate'\? allowed: "),
    ({"stagez": {}}, r"unknown key 'stagez'"),
])
def test_profile_schema_errors_name_file_key_and_allowed_values(tmp_path, edit, message):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"name": "bad", "kind": "generator", **edit}))
    with pytest.raises(PipelineError, match=message) as e:
        load_profile(str(p), "tiny")  # with the model's overrides applied: a misspelled stage is still named
    assert "bad.yaml" in str(e.value)


def test_malformed_yaml_and_unknown_profile(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("stages: {quantize: [unclosed\n")
    with pytest.raises(PipelineError, match="broken.yaml: malformed YAML"):
        load_profile(str(p))
    with pytest.raises(PipelineError, match=r"unknown profile 'nope'.*known: .*rtn4"):
        load_profile("nope")


def test_per_model_overrides_and_plan_command():
    tiny = load_profile("rtn4", "tiny").resolved()
    real = load_profile("rtn4", "moss-tts").resolved()
    assert tiny["stages"]["evaluate"]["nsamples"] < real["stages"]["evaluate"]["nsamples"]
    out = subprocess.run([sys.executable, "-m", "pipelines", "plan", "rtn4", "--model", "tiny"],
                         capture_output=True, text=True, check=True).stdout
    plan = yaml.safe_load(out)
    assert list(plan["stages"]) == ["quantize", "evaluate", "freerun", "gate", "export"]
    assert plan["stages"]["quantize"] == {"method": "rtn", "device": "auto", "bits": 4, "group_size": 128,
                                          "sym": False}


def test_cli_errors_are_one_line_and_non_zero():
    r = subprocess.run([sys.executable, "-m", "pipelines", "quantize", "rtn4", "--model", "nosuch"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown model 'nosuch'" in r.stderr
