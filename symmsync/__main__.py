"""``python -m symmsync doctor``: what this machine can run, and why not.

``python -m symmsync mps start|stop|status|run -- COMMAND``: an MPS daemon for ranks that share
a GPU, so that their kernels run at the same time (docs/gpu.md, "Many ranks on one GPU").
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mps"]:
        from .backends.mps import main as mps_main

        return mps_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m symmsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="GPUs, P2P/NVLink, MPS, driver and library versions, which backends work here")
    sub.add_parser("mps", help="start|stop|status|run -- COMMAND: an MPS daemon for ranks sharing a GPU")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .tools.doctor import report

        text, ok = report()
        print(text)
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
