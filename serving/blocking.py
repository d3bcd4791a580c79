"""Blocking work of a request run off a gevent web process's event loop.

Under gunicorn's gevent workers every request of a process shares one thread: a request that
reads or copies a large file in Python (an upload's lines counted, the file written to
storage) holds every other request of the process until it is done, the interactive ones
included. `off_the_loop` runs such work in gevent's thread pool: the request waits for it,
the others go on. Outside gevent (a threaded server, a test, a management command) it just
calls the function.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def off_the_loop(work: Callable[[], T]) -> T:
    """`work()`, in gevent's thread pool when this process's threads are gevent's."""
    if "gevent" not in sys.modules:
        return work()
    from gevent import get_hub, monkey

    if not monkey.is_module_patched("threading"):
        return work()
    return get_hub().threadpool.apply(work)
