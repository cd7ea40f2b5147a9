"""Generic test plumbing shared by every test folder.

- ``comm`` fixture: mpi4py's COMM_WORLD (only under ``--with-mpi``; see pytest-mpi).
- Agreed verdicts: under ``--with-mpi`` each ``@pytest.mark.mpi`` test's outcome is exchanged over a
  private duplicate of COMM_WORLD (made at session start, never mixed with test traffic); a rank
  whose own test passed while another rank failed reports "failed on rank(s) [...]". Exactly one
  exchange happens per test on every rank (after setup if setup did not pass, else after the
  call). Ranks that diverge inside a test (one fails an assertion and leaves while the others
  wait in its next collective) would block each other; so the exchange waits at most
  ``DISTTENSOR_TEST_VERDICT_WAIT`` s (default 60) for the other ranks, then the lowest waiting
  rank prints a report naming the test, the ranks that never finished it and the failures the
  others saw, and the job is aborted.
- A default per-test timeout (120 s, pytest-timeout) for tests without their own marker.
- ``@pytest.mark.gpu`` tests are skipped where cupy with a CUDA device is not importable.
- ``DISTTENSOR_TEST_STATUS_DIR``: each rank writes the nodeid of the running test to
  ``rank_<k>.current`` there, so ``tests/run_all.py`` can say what a hung run was doing, and a
  running "passed failed skipped" tally to ``rank_<k>.tally`` (counts survive a killed run).
"""
from __future__ import annotations

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lets `pytest tests` work from a plain checkout too
    sys.path.insert(0, ROOT)

DEFAULT_TEST_TIMEOUT = 120
VERDICT_WAIT = float(os.environ.get("DISTTENSOR_TEST_VERDICT_WAIT", 60))
_VERDICT_TAG = 7301
_verdict_comm = None


def _with_mpi(config) -> bool:
    try:
        return bool(config.getoption("with_mpi"))
    except (ValueError, AttributeError):
        return False


def _rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _get_verdict_comm():
    global _verdict_comm
    if _verdict_comm is None:
        from mpi4py import MPI

        _verdict_comm = MPI.COMM_WORLD.Dup()
    return _verdict_comm


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError without a driver, ...
        return False


def pytest_collection_modifyitems(config, items):
    no_gpu = None
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))
        if item.get_closest_marker("gpu") is not None:
            no_gpu = not _cuda_available() if no_gpu is None else no_gpu
            if no_gpu:
                item.add_marker(pytest.mark.skip(
                    reason="cupy with a CUDA device is not available on this machine"))


def pytest_runtest_logstart(nodeid, location):
    status_dir = os.environ.get("DISTTENSOR_TEST_STATUS_DIR")
    if status_dir:
        try:
            with open(os.path.join(status_dir, f"rank_{_rank()}.current"), "w") as f:
                f.write(nodeid + "\n")
        except OSError:
            pass


_tally = {"passed": set(), "failed": set(), "skipped": set()}


def pytest_runtest_logreport(report):
    """Running per-rank tally (``rank_<k>.tally``) so a run that dies still reports counts."""
    status_dir = os.environ.get("DISTTENSOR_TEST_STATUS_DIR")
    if not status_dir:
        return
    nid = report.nodeid
    if report.failed:
        _tally["failed"].add(nid)
        _tally["passed"].discard(nid)
    elif report.skipped and report.when in ("setup", "call"):
        _tally["skipped"].add(nid)
    elif report.when == "call" and report.passed and nid not in _tally["failed"]:
        _tally["passed"].add(nid)
    try:
        with open(os.path.join(status_dir, f"rank_{_rank()}.tally"), "w") as f:
            f.write(" ".join(str(len(_tally[k])) for k in ("passed", "failed", "skipped")) + "\n")
    except OSError:
        pass


def pytest_sessionstart(session):
    if _with_mpi(session.config):
        _get_verdict_comm()  # collective: every rank is in step here, not inside a test


def _short(report) -> str:
    """A failed report's exception line (else its last line), at most 300 characters."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0][:300]
    text = str(report.longrepr or "").strip().splitlines()
    return (text[-1] if text else report.outcome)[:300]


def _exchange_verdicts(comm, nodeid: str, mine: tuple) -> dict:
    """Every rank's ``(failed, summary)`` for test ``nodeid``. Waits at most ``VERDICT_WAIT`` s
    for the other ranks; past that the ranks that never finished the test are named (by the
    lowest rank that did) and the job is aborted, since they are blocked in the test's traffic."""
    me, n = comm.Get_rank(), comm.Get_size()
    sends = [comm.isend(mine, dest=r, tag=_VERDICT_TAG) for r in range(n) if r != me]
    pending = {r: comm.irecv(source=r, tag=_VERDICT_TAG) for r in range(n) if r != me}
    got = {me: mine}
    deadline = time.monotonic() + VERDICT_WAIT
    while pending:
        for r, req in list(pending.items()):
            done, value = req.test()
            if done:
                got[r] = value
                del pending[r]
        if pending and time.monotonic() > deadline:
            _abort_divergence(comm, nodeid, got, sorted(pending))
        elif pending:
            time.sleep(0.0005)
    for req in sends:
        req.wait()
    return got


def _abort_divergence(comm, nodeid: str, got: dict, missing: list) -> None:
    """Report (from the lowest rank that finished ``nodeid``) and abort the job."""
    if comm.Get_rank() == min(got):
        failures = "; ".join(f"rank {r} failed: {s}" for r, (f, s) in sorted(got.items()) if f)
        sys.stderr.write(
            f"[disttensor] job aborted: rank(s) {missing} did not finish test {nodeid} within "
            f"{VERDICT_WAIT:g} s (DISTTENSOR_TEST_VERDICT_WAIT) of rank(s) {sorted(got)}, which "
            f"finished it; {failures or 'no rank failed'}\n")
        sys.stderr.flush()
    else:
        time.sleep(2.0)  # let the reporting rank's line out first
    comm.Abort(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if item.get_closest_marker("mpi") is None or not _with_mpi(item.config):
        return
    if call.when == "setup":
        if report.passed:
            return  # the exchange happens after the call phase
    elif call.when != "call":
        return
    comm = _get_verdict_comm()
    if comm.Get_size() == 1:
        return
    mine = (bool(report.failed), _short(report) if report.failed else "")
    verdicts = _exchange_verdicts(comm, item.nodeid, mine)
    bad = [r for r, (failed, _) in sorted(verdicts.items()) if failed]
    if bad and not report.failed:
        report.outcome = "failed"
        report.longrepr = f"failed on rank(s) {bad} (passed on this rank {comm.Get_rank()})"
    elif bad and report.failed and len(bad) > 1:
        report.sections.append(("mpi verdict", f"failed on rank(s) {bad}"))


@pytest.fixture
def comm():
    """mpi4py COMM_WORLD (tests that use it must be marked ``@pytest.mark.mpi``)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD
