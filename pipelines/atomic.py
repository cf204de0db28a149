"""Folders that appear whole or not at all: built in a temporary sibling, renamed into place."""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(dest: Path, replace: bool = True):
    """Yield an empty temporary folder next to `dest`; when the block ends without an error it
    becomes `dest` in one rename (replacing an existing `dest` when `replace`). On any error, or
    an interrupt, the temporary folder is removed and `dest` is untouched."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if dest.exists() and replace:
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
