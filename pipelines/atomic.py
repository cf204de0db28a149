"""Folders that appear whole or not at all: built in a temporary sibling, synced, renamed into place.

A temporary folder is named `.<dest>.tmp-<pid>`. A process killed with SIGKILL cannot remove its
own, so every new one first removes the temporaries next to it whose process no longer runs.
"""
from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

_TMP = re.compile(r"^\..+\.tmp-(\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_orphans(folder: Path) -> list[Path]:
    """Remove temporaries in `folder` left by processes that are gone; returns what was removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = _TMP.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def fsync_tree(folder: Path) -> None:
    """Every file's data, then every directory entry, on disk: a rename published after this
    survives a power loss with its content."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in sorted([folder, *(p for p in folder.rglob("*") if p.is_dir())], reverse=True):
        fsync_dir(d)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_sibling(dest: Path) -> Path:
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_orphans(dest.parent)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, dest: Path, replace: bool = True) -> None:
    """fsync `tmp`, then rename it to `dest` (replacing an existing one when `replace`)."""
    fsync_tree(tmp)
    if dest.exists() and replace:
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


@contextmanager
def atomic_file(dest: Path, replace: bool = False):
    """Yield a temporary path next to `dest`; when the block ends without an error it is synced and
    renamed to `dest`. Published files are never replaced (dest must not exist) unless `replace`:
    an index that grows."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_orphans(dest.parent)
    if dest.exists() and not replace:
        raise FileExistsError(dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_folder(dest: Path, replace: bool = True):
    """Yield an empty temporary folder next to `dest`; when the block ends without an error it
    becomes `dest` in one rename (replacing an existing `dest` when `replace`). On any error, or
    an interrupt, the temporary folder is removed and `dest` is untouched."""
    dest = Path(dest)
    tmp = temporary_sibling(dest)
    try:
        yield tmp
        publish(tmp, dest, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
