"""``python -m launch --nproc N [--log-dir DIR] [--gpus] [--quiet-others] [--mpiexec PATH]
[--hosts H1,H2 | --hostfile FILE] script.py args...``

Starts N ranks through the installed ``mpiexec`` (``--mpiexec`` overrides; ``--hosts`` and
``--hostfile`` are passed on, in MPICH's or Open MPI's spelling), each under
``launch.rank_wrapper``, which writes ``DIR/rank_<k>.log`` (default DIR: ``./log``), prefixes
console lines with ``[rank k] `` (``--quiet-others``: only rank 0 on the console), and sets
``CUDA_VISIBLE_DEVICES`` to the rank's *local* rank on its node with ``--gpus``. SIGINT/SIGTERM
reach the ranks.

As soon as a rank's recorded exit status is non-zero the launcher stops the job (SIGTERM to
mpiexec, SIGKILL 3 s later). It then prints the failing rank's log first and exits with that
rank's status. The failing rank is the one named by the earliest runtime report
(``[disttensor] job aborted: rank K``), else the one that printed a Python traceback first, else
the first rank with a non-zero status (ranks stopped from outside count last); a status above
128 is reported as the signal that killed the rank. If the failing rank was killed by the MPI
abort before its status was recorded, the launcher exits with 1 (the abort code); if nothing
identifies a rank it exits with mpiexec's status. Imports nothing from the rest of the project.
"""
from .cli import find_mpiexec, main

__all__ = ["main", "find_mpiexec"]
