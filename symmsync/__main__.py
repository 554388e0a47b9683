"""``python -m symmsync doctor``: what this machine can run, and why not."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m symmsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="GPUs, P2P/NVLink, driver and library versions, which backends work here")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .tools.doctor import report

        text, ok = report()
        print(text)
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
