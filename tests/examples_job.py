"""Run example scripts one after another in one Python process, each as ``python SCRIPT ARGS`` runs it.

    python tests/examples_job.py OUT_DIR SCRIPT [ARGS...] [-- SCRIPT [ARGS...]]...

Starting Python and importing torch and symmsync is most of a short example's time on a 2-core
machine; this job pays for it once. Each script runs as ``__main__`` (:func:`runpy.run_path`, its
folder first on ``sys.path``, ``sys.argv`` its own), so the ranks that ``symmsync.testing.run``
spawns import its functions from the script's file, as they do under ``python SCRIPT``. What the
script and its ranks print goes to ``OUT_DIR/<n>.out`` and ``OUT_DIR/<n>.err`` (file descriptors 1
and 2, which the ranks inherit), its exit status to ``OUT_DIR/<n>.rc``: a ``SystemExit``'s code, 0
when it returns, 1 when it raises (the traceback in its ``.err``). tests/tooling/test_examples.py
runs the examples on the host backend through it.
"""

import os
import runpy
import sys
import traceback


def _run(script: str, args: list[str]) -> int:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the script's failure
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main() -> None:
    out_dir, rest = sys.argv[1], sys.argv[2:]
    jobs, job = [], []
    for arg in rest + ["--"]:
        if arg == "--":
            jobs.append(job)
            job = []
        else:
            job.append(arg)
    for n, (script, *args) in enumerate(j for j in jobs if j):
        out = open(os.path.join(out_dir, f"{n}.out"), "w")  # noqa: SIM115 - closed below
        err = open(os.path.join(out_dir, f"{n}.err"), "w")  # noqa: SIM115
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            rc = _run(script, args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            out.close()
            err.close()
        with open(os.path.join(out_dir, f"{n}.rc"), "w") as f:
            f.write(str(rc))


if __name__ == "__main__":
    main()
