"""Run a function on N ranks (one process each) and collect every rank's result.

This is how symmsync's own tests run, and how users test their kernels on a machine
without GPUs::

    import symmsync as ss
    from symmsync.testing import run

    def exchange(n):
        buf = ss.SymmetricBuffer(n, backend="host")
        ...
        return buf.rank

    assert run(exchange, 4, 1024) == [0, 1, 2, 3]

Each rank is a new process with torch.distributed initialized (gloo for the host
backend, NCCL with one GPU per rank for CUDA) and, for the host backend,
``TRITON_INTERPRET=1`` set before anything imports Triton. A CUDA rank is a fresh
interpreter (``spawn``); a host rank is forked from one server process that imported
torch, Triton and symmsync once (``forkserver``, most of a short run's time saved), and
sets its run's environment before it runs ``fn``; a run whose ``env`` sets a variable
read at import (``SYMMSYNC_DEBUG``, ``TRITON_*``, ``TORCH_*``, ...) spawns instead, and
``SYMMSYNC_TESTING_START=spawn`` makes every run spawn. Either way ``fn`` is imported by
name in the rank, from its module (a script's, under ``if __name__ == "__main__":``). The first rank
that raises stops the run: the others are killed and :class:`~symmsync.RankFailure`
carries that rank's traceback. A run that outlives ``timeout_s`` is killed and
names the ranks that never finished, so a deadlock fails fast instead of hanging.
Fault tests name the ranks that are meant to die (``may_die``): those may exit
without a result while the others run on and report.

Inside a ``torchrun`` job the ranks already exist: there :func:`run` starts no
process, calls ``fn`` in this one (initializing torch.distributed from torchrun's
environment first, where nothing did) and returns every rank's result, so the same
script runs as ``python script.py`` and as ``torchrun --nproc-per-node N script.py``.
Print from :func:`is_main_process` only, so that such a script prints once::

    results = run(exchange, 2, 1024)
    if is_main_process():
        print(results)
"""

# One name a line, in the order the reference page shows them (docs/reference/testing.md lists
# a package's members in the order of these lines).
from .ranks import DEFAULT_TIMEOUT_S  # noqa: I001
from .env import TORCHRUN_ENV
from .ranks import Died
from .env import under_torchrun
from .env import is_main_process
from .env import sharing_gpus
from .env import mps
from .env import sharing_env
from .ranks import run
from .pool import RankPool
from ..errors import RankFailure as RankFailure  # raised by run() and RankPool; the tests import it from here

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TORCHRUN_ENV",
    "Died",
    "under_torchrun",
    "is_main_process",
    "sharing_gpus",
    "mps",
    "sharing_env",
    "run",
    "RankPool",
]
