"""`file_size_limit`: a full disk on demand, for the tests of what a failed write leaves behind.

While it is active, files this process writes may not grow past `num_bytes`; a larger write fails with the
OS's own "File too large" (EFBIG; SIGXFSZ is ignored meanwhile), through whatever library is writing, as
when a disk fills up. The process's previous limit and handler are restored on exit.
"""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def file_size_limit(num_bytes: int) -> Iterator[None]:
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
