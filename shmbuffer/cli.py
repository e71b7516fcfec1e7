"""The ``shmbuffer`` command."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    example = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    if not example.exists():
        print(f"the demo runs {example}, which is not there (install from a checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(example), *args.rest]
    runpy.run_path(str(example), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmbuffer", description="A replay buffer in shared memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo")
    demo.set_defaults(run=_demo)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
