"""``python -m launch --nproc N [--log-dir DIR] [--gpus] [--quiet-others] [--mpiexec PATH] script.py args...``

Starts N ranks through the installed ``mpiexec`` (``--mpiexec`` overrides), each under
``launch.rank_wrapper``, which writes ``DIR/rank_<k>.log`` (default DIR: ``./log``), prefixes
console lines with ``[rank k] `` (``--quiet-others``: only rank 0 on the console), and sets
``CUDA_VISIBLE_DEVICES`` to the local rank with ``--gpus``. SIGINT/SIGTERM reach the ranks.

When a rank fails, the launcher prints that rank's log (its traceback) first and exits with that
rank's exit status. The failing rank is the one that printed a Python traceback first, else the
first rank with a non-zero status. If the failing rank was killed by the MPI abort before its
status was recorded (an unhandled exception under ``collectives`` calls ``MPI_Abort(1)``), the
launcher exits with 1 (the abort code); if nothing identifies a rank it exits with mpiexec's
status. Imports nothing from the rest of the project.
"""
from .cli import find_mpiexec, main

__all__ = ["main", "find_mpiexec"]
