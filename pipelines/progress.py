"""Progress on long work: bars silent when stderr is not a terminal, and the host memory a
per-block log line reports."""
import sys

from tqdm.auto import tqdm


def progress(iterable, desc: str, unit: str = "it", total=None, initial: int = 0):
    return tqdm(iterable, desc=desc, unit=unit, total=total, initial=initial, disable=not sys.stderr.isatty(),
                leave=False)


def host_rss_gib(field: str = "VmRSS") -> float | None:
    """This process's resident set now (VmRSS) or its peak since the last reset (VmHWM), in GiB;
    None where /proc/self/status does not tell it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None
