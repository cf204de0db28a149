"""Everything the project generates and then pins is the same bytes under every CPU kernel and
thread count this machine offers (issue 14): regenerated in fresh processes, compared with the
committed pins."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from pipelines.source import CONFIGS, ROOT

# Every calibration / evaluation set that pins its codes (the codec's validation set pins its own way).
SETS = sorted(p.stem for p in (CONFIGS / "calibration").glob("*.yaml") if "codes_pin" in yaml.safe_load(p.read_text()))

CHILD = r"""
import hashlib, json, sys, tempfile, torch
from pathlib import Path
from pipelines import calibration, codec_eval as codec
from pipelines.checkpoint import sha256_file
from pipelines.fixtures import fixture_config, write_any_fixture
out = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "files": {}}
with tempfile.TemporaryDirectory() as tmp:
    for name in ("tiny", "codec-tiny"):
        folder = write_any_fixture(name, Path(tmp) / name)
        out["files"][name] = {p.name: sha256_file(p) for p in sorted(folder.iterdir())}
config = fixture_config("tiny")
out["calibration"] = {}
for name in SETS:
    spec, _ = calibration.load_dataset_spec(name)
    pin = spec["codes_pin"]
    codes = calibration.code_process(calibration.stream_name(spec), range(pin["sequences"]), pin["frames"],
                                     pin["n_vq"], pin["codebook_size"], spec["codes"])
    out["calibration"][name] = {"codes_pin": calibration.codes_digest(codes),
                                "tiny_16x128": calibration.build(name, config, 16, 128).sha256}
out["codec_validation"] = codec.load_validation_set(check_pin=False).sha256
print(json.dumps(out))
""".replace("SETS", repr(SETS))


def _capabilities() -> list[str]:
    """torch's x86 kernels this CPU can run (ATEN_CPU_CAPABILITY refuses nothing: a kernel the CPU
    lacks would crash, so only those its flags allow)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    caps = ["default"]
    if "avx2" in flags:
        caps.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        caps.append("avx512")
    return caps


def _numpy_simd_off() -> str:
    from numpy._core._multiarray_umath import __cpu_dispatch__  # the features numpy may dispatch to

    return " ".join(__cpu_dispatch__)


@pytest.fixture(scope="module")
def regenerated():
    runs = {}
    for cap in _capabilities():
        for threads in (1, 2):
            env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                       NPY_DISABLE_CPU_FEATURES=_numpy_simd_off(), PYTHONPATH=str(ROOT))
            r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, cwd=ROOT)
            assert r.returncode == 0, r.stderr[-2000:]
            runs[(cap, threads)] = json.loads(r.stdout.strip().splitlines()[-1])
    return runs


def test_every_kernel_and_thread_count_was_really_used(regenerated):
    for (cap, threads), out in regenerated.items():
        assert out["capability"].lower() == cap and out["threads"] == threads


@pytest.mark.parametrize("model", ["tiny", "codec-tiny"])
def test_fixtures_equal_their_committed_pins(regenerated, model):
    pins = yaml.safe_load((CONFIGS / "models" / f"{model}.yaml").read_text())["files"]
    for key, out in regenerated.items():
        assert out["files"][model] == pins, f"{model} under {key}: bytes differ from configs/models/{model}.yaml"


@pytest.mark.parametrize("name", SETS)
def test_calibration_sets_equal_their_pins_and_each_other(regenerated, name):
    pin = yaml.safe_load((CONFIGS / "calibration" / f"{name}.yaml").read_text())["codes_pin"]["sha256"]
    built = {out["calibration"][name]["tiny_16x128"] for out in regenerated.values()}
    assert len(built) == 1, f"{name}: the tiny 16x128 set differs between kernels/threads"
    for key, out in regenerated.items():
        assert out["calibration"][name]["codes_pin"] == pin, f"{name} under {key}"


def test_codec_validation_codes_equal_their_pin(regenerated):
    pin = yaml.safe_load((CONFIGS / "calibration" / "codec-validation-v1.yaml").read_text())["codes_sha256"]
    assert {out["codec_validation"] for out in regenerated.values()} == {pin}


def test_same_named_tensors_are_not_the_same_draws():
    """Seeds hash the full name: lm_heads.12 and lm_heads.21 (equal character sums) differ."""
    from pipelines.fixtures import fixture_config, make_tensor

    cfg = fixture_config("tiny")
    a, b = make_tensor("lm_heads.12.weight", (65, 256), cfg, 0), make_tensor("lm_heads.21.weight", (65, 256), cfg, 0)
    assert not a.equal(b)
    e1, e2 = make_tensor("emb_ext.11.weight", (65, 256), cfg, 0), make_tensor("emb_ext.20.weight", (65, 256), cfg, 0)
    assert not e1.equal(e2)


def test_generation_is_the_same_in_chunks_and_on_any_device_order():
    """Value j of a stream depends only on (name, j): a chunked draw equals a whole one."""
    import torch

    from pipelines import portable_random as rnd

    whole = rnd.student_t("x", (3000,), df=8)
    old = rnd.CHUNK
    try:
        rnd.CHUNK = 512
        assert torch.equal(rnd.student_t("x", (3000,), df=8), whole)
    finally:
        rnd.CHUNK = old


def test_student_t_has_the_tails_it_promises():
    """Unit variance and kurtosis 3 + 6/(df - 4): 4.5 at df=8 (what makes the fixture hard)."""
    from pipelines import portable_random as rnd

    x = rnd.student_t("tails", (2_000_000,), df=8)
    var = float(x.var())
    kurt = float(((x - x.mean()) ** 4).mean() / x.var() ** 2)
    assert abs(var - 1) < 0.01 and abs(kurt - 4.5) < 0.15


def test_bfloat16_rounding_matches_round_to_nearest_even():
    import torch

    from pipelines import portable_random as rnd

    x = rnd.student_t("bf16", (100_000,), df=4)
    assert torch.equal(rnd.to_bfloat16(x).view(torch.int16), x.float().to(torch.bfloat16).view(torch.int16))


def test_large_tables_made_a_slice_of_rows_at_a_time_are_the_same_tensor(monkeypatch):
    """The full-shape tables (600M entries) are drawn in row slices; the slices join into the same tensor."""
    import torch

    import pipelines.fixtures as fixtures

    cfg = fixtures.fixture_config("tiny")
    whole = fixtures.make_tensor("language_model.embed_tokens.weight", (1024, 256), cfg, 0)
    monkeypatch.setattr(fixtures, "ROW_BLOCK_ELEMENTS", 256 * 37)  # 37 rows a slice, the last one short
    assert torch.equal(fixtures.make_tensor("language_model.embed_tokens.weight", (1024, 256), cfg, 0), whole)
