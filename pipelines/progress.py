"""Progress bars on long work; silent when stderr is not a terminal."""
import sys

from tqdm.auto import tqdm


def progress(iterable, desc: str, unit: str = "it", total=None, initial: int = 0):
    return tqdm(iterable, desc=desc, unit=unit, total=total, initial=initial, disable=not sys.stderr.isatty(),
                leave=False)
