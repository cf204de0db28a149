import json
import shutil
import subprocess
import sys

import pytest
import yaml

from pipelines.checkpoint import canonical_json, sha256_file
from pipelines.cli import build
from pipelines.profile import known_profiles
from pipelines.rebuild import rebuild


def _copy_bundle(ctx, tmp_path):
    dst = tmp_path / ctx.bundle.name
    shutil.copytree(ctx.bundle, dst)
    return dst


def test_rebuild_reports_identical_and_warns_on_environment_drift(rtn4_build, tmp_path):
    b = _copy_bundle(rtn4_build, tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    m["environment"]["torch"] = "0.0.1"  # not a payload file: only the warning changes
    (b / "manifest.json").write_text(canonical_json(m, indent=2))
    logs = []
    diffs, rebuilt = rebuild(b, scratch=tmp_path / "scratch", log=logs.append)
    assert diffs == []
    assert any("torch: built with 0.0.1" in line for line in logs)
    assert rebuilt.name == b.name  # same inputs, same version id


def test_a_changed_recipe_makes_rebuild_fail_and_name_the_difference(rtn4_build, tmp_path):
    b = _copy_bundle(rtn4_build, tmp_path)
    recipe = yaml.safe_load((b / "recipe.yaml").read_text())
    recipe["stages"]["quantize"]["group_size"] = 64  # the recorded recipe no longer made these bytes
    (b / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    m = json.loads((b / "manifest.json").read_text())
    m["files"]["recipe.yaml"] = {"sha256": sha256_file(b / "recipe.yaml"), "size": (b / "recipe.yaml").stat().st_size}
    (b / "manifest.json").write_text(canonical_json(m, indent=2))
    r = subprocess.run([sys.executable, "-m", "pipelines", "rebuild", str(b)], capture_output=True, text=True)
    assert r.returncode == 4
    assert "model.safetensors: differs" in r.stdout
    assert ".qzeros: torch.int32[2, " in r.stdout or ".scales: torch.float16[2, " in r.stdout  # 256/128 -> 256/64 groups
    assert r.stderr.strip().splitlines()[-1].startswith("error: rebuild of")


def test_rebuild_of_a_bundle_pulled_from_the_registry(rtn4_build, tmp_path):
    from pipelines.registry import open_registry, pull, push

    reg = open_registry(f"oci-layout:{tmp_path / 'layout'}")
    push(reg, rtn4_build.bundle)
    pulled = tmp_path / "pulled"
    pull(reg, rtn4_build.bundle.name, pulled)
    diffs, _ = rebuild(pulled, scratch=tmp_path / "scratch", log=lambda m: None)
    assert diffs == []


@pytest.mark.parametrize("profile", known_profiles())
def test_every_profile_builds_bit_identically_twice(profile, tmp_path):
    a = build(profile, "tiny", use_cache=False, cache_root=tmp_path / "c1", bundle_root=tmp_path / "b1").bundle
    b = build(profile, "tiny", use_cache=False, cache_root=tmp_path / "c2", bundle_root=tmp_path / "b2").bundle
    assert a.name == b.name
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"{profile}: {f} differs between two builds"
