"""The death watcher's reading of a dead rank's exit status (collectives/_watcher.py), on plain
child processes: from ``/proc/<pid>/stat`` while the process is a zombie, and from a pidfd
opened before it died once it has been reaped. (The whole watcher runs in test_fault_matrix.)"""
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from collectives import _watcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

CASES = {  # child code -> the status the watcher must read
    "import os; os.kill(os.getpid(), 9)": ("signal", signal.SIGKILL),
    "import ctypes; ctypes.string_at(0)": ("signal", signal.SIGSEGV),
    "import os; os._exit(3)": ("exit", 3),
    "pass": ("exit", 0),
}


def dead_child(code: str):
    """A child that ran ``code`` and has exited but is not reaped yet, and its pidfd."""
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(1); " + code],
                         stdin=subprocess.PIPE)
    pidfd = os.pidfd_open(p.pid)
    p.stdin.close()  # now it runs ``code``
    for _ in range(500):
        if (_watcher._stat(p.pid) or ["Z"])[0] == "Z":
            break
        time.sleep(0.01)
    return p, pidfd


@pytest.mark.parametrize("code", list(CASES))
def test_status_of_an_unreaped_process(code):
    p, pidfd = dead_child(code)
    try:
        assert _watcher._exit_status(p.pid, pidfd) == CASES[code]
    finally:
        p.wait()
        os.close(pidfd)


@pytest.mark.parametrize("code", list(CASES))
def test_status_after_the_parent_reaped_it(code):
    p, pidfd = dead_child(code)
    p.wait()
    try:
        if _watcher._reaped_status(pidfd) is None:
            try:  # tell an old kernel from a broken reading
                import fcntl
                fcntl.ioctl(pidfd, _watcher._PIDFD_GET_INFO, bytearray(64))
            except OSError as e:
                if e.errno in (errno.ENOTTY, errno.EINVAL):
                    pytest.skip("this kernel (< 6.15) keeps no exit status in pidfds")
        assert _watcher._exit_status(p.pid, pidfd) == CASES[code]
    finally:
        os.close(pidfd)


def test_a_live_process_is_healthy_and_a_killed_one_is_not():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _watcher._dying(p.pid) == (False, False)
        assert p.pid in _watcher._children(os.getpid())
        p.kill()
        for _ in range(500):
            if _watcher._dying(p.pid)[0]:
                break
            time.sleep(0.01)
        assert _watcher._dying(p.pid) == (True, False)  # killed: not a normal exit
    finally:
        p.kill()
        p.wait()
    assert _watcher._dying(p.pid) == (True, False)  # gone
