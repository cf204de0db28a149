"""Block checkpoints: an engine run survives an interruption between blocks (the quantize stage's
36 blocks of auto-round outlast one 10-minute command).

After block i's hook returns, the engine writes into the stage's partial folder
`block-<i>.safetensors` (the hook's results for that block: its tensors, its JSON record in the
header), then `streams.safetensors` (the quant activations leaving block i, when the hook has that
stream: only the latest is kept, replaced in one rename), in a thread while block i+1 computes.
Every file is written to a temporary name, synced and renamed (pipelines/atomic.py), so a kill
leaves whole files only. A re-run finds them, hands blocks 0..i back to the hook
(`restore_block`), recomputes the fp stream through the source blocks 0..i (cheaper than writing
it: it depends on nothing the run decided) and continues at block i+1.

The folder is `<cache>/<stage>/<key>.partial/`, next to where the finished stage will be
published: the key covers everything that can change the stage's output (params, upstream keys,
pins, seed, device kind, code), so a partial is only ever read by a run that would have written
the same bytes. The stage runner removes it once the stage is published.

A partial that cannot be used (a file truncated or unreadable, a block missing, streams that do
not fit this run) is discarded with one log line naming the file and what was expected, and the
stage starts again at block 0: a re-run always finishes, and never on state it cannot trust.
"""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from .atomic import atomic_file
from .checkpoint import Checkpoint, Lazy, canonical_json, write_safetensors
from .errors import PipelineError

STREAMS = "streams.safetensors"


def block_file(i: int) -> str:
    return f"block-{i:03d}.safetensors"


class Unusable(Exception):
    """A partial that cannot be resumed from (the message names the file and what was expected)."""


def _open(path: Path) -> tuple[Checkpoint, dict[str, str]]:
    """A checkpoint file, its header checked against its length, and its header's metadata; its
    tensors are read only when asked for (into fresh memory, never views of a map: the pages a
    map's reader touches stay resident while the view lives)."""
    if not path.is_file():
        raise Unusable(f"{path.name}: missing")
    try:
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
        return Checkpoint(path.parent, single=path.name), meta
    except (OSError, SafetensorError, PipelineError) as e:
        raise Unusable(f"{path.name}: unreadable safetensors ({e})") from None


def _lazies(ckpt: Checkpoint) -> dict[str, Lazy]:
    return {k: ckpt.lazy(k) for k in ckpt.keys()}


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    with atomic_file(path, replace=True) as tmp:
        write_safetensors(tmp, tensors, metadata)


class BlockCheckpoint:
    """One engine run's block checkpoints in `folder` (named in log lines by its stage: the parent folder)."""

    def __init__(self, folder: Path, log: Callable[[str], None]):
        self.folder, self.log = Path(folder), log
        self.stage = self.folder.parent.name
        self._writing: tuple[int, threading.Thread, list] | None = None

    def save(self, i: int, hook, quant: torch.Tensor | None) -> int | None:
        """Block i is finished: its hook state, then the quant stream leaving it (the order a resume
        relies on), written by a thread while the next block computes (a stream is 0.5-2 GiB: seconds
        of disk per block). `quant` must not change until wait() returns. Waits for block i-1's
        files first and returns its index (now on disk), or None."""
        tensors, meta = hook.block_state(i)
        tensors = {k: v.detach().cpu() for k, v in tensors.items()}  # copied here: the thread only reads host memory
        streams = {} if quant is None else {"quant": quant}
        done = self.wait()
        files = [(self.folder / block_file(i), tensors, {"block": str(i), "state": canonical_json(meta)}),
                 (self.folder / STREAMS, streams, {"block": str(i)})]
        errors: list[BaseException] = []

        def write():
            try:
                for args in files:
                    _write(*args)
            except BaseException as e:  # re-raised by wait() in the engine's thread
                errors.append(e)

        thread = threading.Thread(target=write, name=f"checkpoint block {i}", daemon=True)
        thread.start()
        self._writing = (i, thread, errors)
        return done

    def wait(self) -> int | None:
        """The pending block's files on disk (its write's error raised here): its index, or None."""
        if self._writing is None:
            return None
        i, thread, errors = self._writing
        self._writing = None
        thread.join()
        if errors:
            raise errors[0]
        return i

    def lazy(self, i: int) -> dict[str, Lazy]:
        """Block i's saved tensors, each read from its file when asked for (the quantize stage's
        streamed write): 36 blocks of packed weights need not stay resident."""
        return _lazies(_open(self.folder / block_file(i))[0])

    def restore(self, hook, n_blocks: int, fp: torch.Tensor, quant: torch.Tensor | None, empty=torch.empty):
        """-> (first block to run, quant stream): (0, quant) when there is nothing usable to resume
        from; otherwise the hook holds blocks 0..i again and the quant stream leaves block i, read
        into `empty(shape, dtype)` (the engine's page-locked host memory: a map of the file would
        be pageable, and every batch staged from it a synchronous copy). `fp`, the embeddings,
        gives the shape; the caller recomputes the fp stream."""
        if not (self.folder / STREAMS).is_file():
            return 0, quant  # no block finished (or none since its streams were written): start over
        try:
            last, quant, records = self._load(n_blocks, fp, quant, empty)
        except Unusable as e:
            self.log(f"{self.folder}/{e}; partial discarded, {self.stage} restarts at block 0")
            shutil.rmtree(self.folder, ignore_errors=True)
            return 0, quant
        for i, (tensors, meta) in enumerate(records):
            hook.restore_block(i, tensors, meta)
        done = f"blocks 0..{last}" if last else "block 0"
        self.log(f"resuming {self.stage} at block {last + 1}/{n_blocks} ({done} from {self.folder})")
        return last + 1, quant

    def _load(self, n_blocks: int, fp: torch.Tensor, quant: torch.Tensor | None, empty):
        streams, meta = _open(self.folder / STREAMS)
        try:
            last = int(meta["block"])
        except (KeyError, ValueError):
            raise Unusable(f"{STREAMS}: header lacks the block index") from None
        if not 0 <= last < n_blocks:
            raise Unusable(f"{STREAMS}: block {last}, expected one of 0..{n_blocks - 1}")
        want = [] if quant is None else ["quant"]
        if streams.keys() != want:
            raise Unusable(f"{STREAMS}: tensors {streams.keys()}, expected {want}")
        if quant is not None and streams.shape("quant") != list(fp.shape):  # its dtype is the hook's output's
            raise Unusable(f"{STREAMS}: quant stream {streams.shape('quant')}, expected {list(fp.shape)}")
        records = []
        for i in range(last + 1):
            ckpt, header = _open(self.folder / block_file(i))
            try:
                if int(header["block"]) != i:
                    raise ValueError
                records.append((_lazies(ckpt), json.loads(header["state"])))
            except (KeyError, ValueError):
                raise Unusable(f"{block_file(i)}: header lacks block {i}'s index and JSON state") from None
        restored = None
        if quant is not None:  # read last: 2 GiB, once everything else is known to be usable
            stream = streams.lazy("quant")
            try:
                restored = streams.get("quant", check_finite=False, out=empty(stream.shape, stream.dtype))
            except PipelineError as e:
                raise Unusable(f"{STREAMS}: unreadable ({e})") from None
        return last, restored, records
