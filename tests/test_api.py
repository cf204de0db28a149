"""The house (issue 15): stage keys over each stage's own code, `--set` overrides checked like the
YAML, a model YAML's local `path:`, the runner importing no stage."""
import shutil
import subprocess
import sys

import pytest
import yaml

from pipelines import api, stages
from pipelines.errors import PipelineError
from pipelines.import_graph import closure, module_graph
from pipelines.source import ROOT


def test_a_stage_key_hashes_only_the_code_that_stage_runs():
    graph = module_graph(ROOT)
    quantize = closure(graph, "pipelines.quantize")
    assert {"pipelines.methods.awq", "pipelines.engine", "quantizers.formats.gptq"} <= quantize
    for unrelated in ("pipelines.report", "pipelines.registry.client", "pipelines.rebuild", "pipelines.cli",
                      "pipelines.evaluate", "pipelines.export"):
        assert unrelated not in quantize, unrelated  # editing it cannot invalidate a cached quantize stage
    assert "pipelines.report" not in closure(graph, "pipelines.export")
    assert stages.stage_code("pipelines.quantize") != stages.stage_code("pipelines.gate")


def test_the_runner_imports_no_stage():
    graph = module_graph(ROOT)
    runner = closure(graph, "pipelines.stages")
    assert not runner & {"pipelines.quantize", "pipelines.evaluate", "pipelines.export", "pipelines.calibration",
                         "pipelines.gate", "pipelines.pipeline", "pipelines.codec_eval"}


def test_set_overrides_are_checked_by_the_same_schema():
    from pipelines.profile import parse_overrides

    prof = api.plan("rtn4", "tiny", parse_overrides(["quantize.group_size=64", "evaluate.nsamples=2"]))
    assert prof.stages["quantize"].config.group_size == 64 and prof.stages["evaluate"].nsamples == 2
    with pytest.raises(PipelineError, match=r"stages.quantize.group_size: 100 is not supported"):
        api.plan("rtn4", "tiny", parse_overrides(["quantize.group_size=100"]))
    with pytest.raises(PipelineError, match=r"stages.quantize: unknown key 'bitz'"):
        api.plan("rtn4", "tiny", parse_overrides(["quantize.bitz=3"]))
    with pytest.raises(PipelineError, match=r"--set calibrate.…: the profile configs/profiles/rtn4.yaml has no stage 'calibrate'"):
        api.plan("rtn4", "tiny", parse_overrides(["calibrate.nsamples=2"]))
    with pytest.raises(PipelineError, match=r"--set 'group_size=64': expected STAGE.KEY=VALUE"):
        parse_overrides(["group_size=64"])


def test_set_on_the_command_line_reaches_the_plan():
    r = subprocess.run([sys.executable, "-m", "pipelines", "plan", "awq4", "--model", "tiny",
                        "--set", "quantize.nsamples=4", "--set", "calibrate.seqlen=64"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    plan = yaml.safe_load(r.stdout)
    assert plan["stages"]["quantize"]["nsamples"] == 4 and plan["stages"]["calibrate"]["seqlen"] == 64
    r = subprocess.run([sys.executable, "-m", "pipelines", "plan", "awq4", "--set", "quantize.bits=3"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "bits: AWQ GEMM is 4-bit only" in r.stderr


def test_a_model_yaml_may_name_its_local_snapshot(tiny_path, tmp_path, monkeypatch):
    import pipelines.source as source

    configs = tmp_path / "configs"
    shutil.copytree(source.CONFIGS, configs)
    spec = yaml.safe_load((configs / "models" / "tiny.yaml").read_text())
    spec.pop("fixture")
    spec["path"] = str(tiny_path)
    (configs / "models" / "tiny.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(source, "CONFIGS", configs)
    assert source.resolve_path(source.load_model_spec("tiny")) == tiny_path
    spec["path"] = "nowhere"
    (configs / "models" / "tiny.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(PipelineError, match=r"looked in .*nowhere \(the YAML's path\)"):
        source.resolve_path(source.load_model_spec("tiny"))
