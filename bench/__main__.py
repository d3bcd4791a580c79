"""The benchmarks' one command line: `python -m bench <name> [options]`.

Each benchmark is a module or package `bench.<name>` with a docstring (its first line is its
description here), `add_arguments(parser)` and `main(args)`. Only the one named is imported:
the others' imports (torch, gevent's patching) cost nothing.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = (
    "frontend",
    "compare",
    "gap",
    "sampler",
    "openai_load",
    "overload",
    "soak",
    "redis_cost",
    "routing",
    "streaming",
    "backfill",
    "profile_fit",
)
# Benchmarks whose measurements run on gevent: patched before anything else is imported.
GEVENT = {"frontend"}


def description(name: str) -> str:
    """The first line of the benchmark's docstring, read without importing it."""
    spec = importlib.util.find_spec(f"bench.{name}")
    assert spec is not None, name
    assert spec.origin is not None, name
    docstring = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
    return docstring.splitlines()[0] if docstring else ""


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    return "benchmarks:\n" + "\n".join(
        f"  {name:<{width}}  {description(name)}" for name in BENCHMARKS
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run one benchmark; `python -m bench NAME --help` for its options.",
        epilog=listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", metavar="NAME", help="the benchmark (below)")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options")
    chosen = parser.parse_args(argv)
    name = chosen.name.replace("-", "_")
    if name not in BENCHMARKS:
        parser.error(f"no benchmark {chosen.name!r}\n\n{listing()}")
    if name in GEVENT:
        from gevent import monkey

        monkey.patch_all()
    module = importlib.import_module(f"bench.{name}")
    own = argparse.ArgumentParser(
        prog=f"python -m bench {name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(own)
    return module.main(own.parse_args(chosen.options)) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
