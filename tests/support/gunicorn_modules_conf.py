"""The service's gunicorn config, plus a hook that writes, after each request, the modules the
web process has imported to $MODULES_DUMP_DIR/<pid>.txt: for the test that a web process never
loads the GPU workers' runtime."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from devstack.stack import ROOT

globals().update(
    {
        name: value
        for name, value in runpy.run_path(str(ROOT / "inference_site" / "gunicorn.conf.py")).items()
        if not name.startswith("__")
    }
)


def post_request(worker: Any, req: Any, environ: Any, resp: Any) -> None:
    # The hook runs after the client has its answer: write aside, then rename, so that a
    # reader never sees a half-written list.
    folder = Path(os.environ["MODULES_DUMP_DIR"])
    partial = folder / f"{os.getpid()}.partial"
    partial.write_text("\n".join(sorted(sys.modules)))
    partial.replace(folder / f"{os.getpid()}.txt")
