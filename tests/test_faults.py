"""Bad input and faults seen on a fresh clone (issue 14): one line, nothing written, nothing orphaned."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pipelines import atomic
from pipelines.api import build
from pipelines.errors import PipelineError
from pipelines.source import ROOT


def _pinned_copy(tiny_path, tmp_path, monkeypatch, edit_config):
    """A user's pinned copy of tiny whose config.json was edited (and re-pinned)."""
    import pipelines.source as source

    snap = tmp_path / "snap"
    shutil.copytree(tiny_path, snap)
    cfg = json.loads((snap / "config.json").read_text())
    edit_config(cfg)
    (snap / "config.json").write_text(json.dumps(cfg))
    configs = tmp_path / "configs"
    shutil.copytree(source.CONFIGS, configs)
    monkeypatch.setattr(source, "CONFIGS", configs)
    source.pin("tiny", snap)
    return snap


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.pop("n_vq"), "key 'n_vq' missing"),
    (lambda c: c["language_config"].pop("num_key_value_heads"), "language_config: key 'num_key_value_heads' missing"),
    (lambda c: c["language_config"].update(hidden_size="256"), "language_config: hidden_size must be a positive integer"),
])
def test_a_config_lacking_a_field_is_one_line_before_any_stage(tiny_path, tmp_path, monkeypatch, edit, key):
    snap = _pinned_copy(tiny_path, tmp_path, monkeypatch, edit)
    with pytest.raises(PipelineError) as e:
        build("rtn4", "tiny", model_path=snap, cache_root=tmp_path / "cache", bundle_root=tmp_path / "out")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{snap / 'config.json'}: ") and key in msg
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()  # no stage ran, none was cached


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temporaries_of_dead_processes_are_cleaned_live_ones_kept(tmp_path):
    orphan = tmp_path / f".quantize-abc.tmp-{_dead_pid()}"
    orphan.mkdir()
    (orphan / "partial.safetensors").write_bytes(b"x")
    live = tmp_path / f".other.tmp-{os.getppid()}"  # a running process (our parent)
    live.mkdir()
    with atomic.atomic_folder(tmp_path / "dest") as tmp:
        (tmp / "f").write_text("done")
    assert not orphan.exists() and live.exists() and (tmp_path / "dest" / "f").read_text() == "done"


def test_a_build_killed_with_sigkill_leaves_no_orphan_after_the_next_run(tmp_path):
    """awq4's quantize stage takes seconds on tiny: kill the build inside it, then build again."""
    env = dict(os.environ, MOSSQUANT_ARTIFACTS=str(tmp_path / "artifacts"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pipelines", "quantize", "awq4", "--model", "tiny"]
    cache = tmp_path / "artifacts" / ".cache" / "quantize"
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.time() + 300
    while time.time() < deadline and not (cache.is_dir() and any(cache.glob(".*.tmp-*"))):
        time.sleep(0.05)
    assert p.poll() is None, "the build finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert any(cache.glob(".*.tmp-*"))  # SIGKILL leaves it: nothing in the process can run
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-1500:]
    left = [p for p in (tmp_path / "artifacts").rglob("*") if ".tmp-" in p.name]
    assert left == []


def test_published_folders_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(a, b):
        renamed.append((str(a), list(synced)))
        return real_replace(a, b)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    with atomic.atomic_folder(tmp_path / "dest") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.bin").write_bytes(b"a")
        (tmp / "b.bin").write_bytes(b"b")
    (src, before), = renamed
    assert {f"{src}/sub/a.bin", f"{src}/b.bin", f"{src}/sub", src} <= set(before)


def test_rejection_line_names_the_profile_and_stage_lines_carry_timing(tmp_path):
    env = dict(os.environ, MOSSQUANT_ARTIFACTS=str(tmp_path / "artifacts"), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "pipelines", "quantize", "rtn4", "--model", "tiny"], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 3  # rtn4 runs past BF16's end of audio on tiny (free-running check)
    assert "rtn4 on tiny: rejected by the quality gate: free.runaway_excess" in r.stderr
    assert "stage quantize: done in " in r.stderr and "\x1b[" not in r.stderr  # plain lines off a terminal
