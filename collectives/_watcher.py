"""Death watcher: names a rank that died outside Python (SIGKILL, segfault, ``os._exit``) under a
plain ``mpiexec`` (``python -m launch`` names such ranks itself and turns it off).

A rank that dies without running Python's exit path cannot report itself, and MPI's process
manager kills the other ranks while they are blocked in C. So :func:`start` (called by
``collectives.failure.install``) gives every rank a small watcher process, ``python -I -S
_watcher.py``, in its own session (hydra kills each rank's process group) that inherits the
rank's stderr (mpiexec waits for it, so its line gets out) and reads a pipe whose only writer
is the rank:

- the rank writes lines: ``F <path>`` for each of the MPI library's shared-memory files it
  maps, once MPI is initialized (a job that does not reach MPI_Finalize leaves them in
  /dev/shm, so a watcher whose rank died removes them), and :data:`CLEAN` at the end of its
  exit path: the watcher exits at once, silent (so it is never what a normal job's end waits
  for);
- the runtime's own aborts first create the job's ``claim`` file (:func:`claim`): they have
  printed their report, and every watcher of the job stays silent;
- end of file without either: the rank died outside Python. Its watcher reads the exit status
  (``/proc/<pid>/stat`` until the parent reaps the rank, then the pidfd it opened at start,
  which keeps it on Linux >= 6.15), notes whether the other ranks under the same parent were
  all still healthy, and records its time of death in the job directory (temp dir, keyed by
  the parent's pid and start time). After :data:`GRACE` s every watcher reads the records; the
  rank that died first, among deaths other than by SIGKILL when there are any (the process
  manager stops the others with SIGKILL) and preferring one whose peers were all healthy then
  (the process manager kills the others only after it), is blamed by its own watcher, which
  claims the job and prints ``[disttensor] job aborted: rank K (pid P on host H) was killed by
  signal N (NAME); ranks [...] were stopped because of it``.

Nothing is printed for an exit with status 0 (or an unknown status while a peer exited
normally: every rank may leave by ``os._exit(0)``), when the parent was gone (MPI's own abort),
or when a watcher started after its rank had died (no time of death to compare). Watchers run
only when every rank of the job is on this host (MPI_LOCALNRANKS == PMI_SIZE): across hosts a
rank stopped by the process manager could not be told from the one that died first.
"""
from __future__ import annotations

import os
import sys
import time  # (the watcher imports nothing else at start: it must start fast)

CLEAN = b"C"
GRACE = 0.3  # s every watcher waits for the others' records before deciding
ENV = "DISTTENSOR_WATCHER"  # "0": no watcher (python -m launch sets it)
_LOCAL_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
_WORLD_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")

#: the MPI library's shared-memory files (MPICH's posix segments): MPI_Finalize removes them,
#: a job ended by an abort or by a rank's death leaves them in /dev/shm
SEGMENT_PREFIXES = ("/dev/shm/mpich_shm_",)

_fd: int | None = None  # the rank's end of the pipe
_proc = None  # the watcher (kept so that its Popen is never collected while it runs)
_parent = 0  # the rank's parent (the process manager's local proxy)


# -- /proc ------------------------------------------------------------------------------------

def _stat(pid: int) -> list | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str:
    s = _stat(pid)
    return s[19] if s else "0"


def job_dir(parent: int) -> str:
    """Where the watchers of the ranks under ``parent`` meet (created on first failure)."""
    tmp = next((os.environ[v] for v in ("TMPDIR", "TEMP", "TMP") if os.environ.get(v)), "/tmp")
    base = os.path.join(tmp, f"disttensor-{os.getuid()}")
    return os.path.join(base, f"{parent}-{_start_time(parent)}")


_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info), Linux >= 6.15
_PIDFD_INFO_EXIT = 1 << 3


def _reaped_status(pidfd: int | None) -> int | None:
    """The wait status kept by a pidfd opened before the process exited (Linux >= 6.15)."""
    if pidfd is None:
        return None
    import fcntl
    import struct

    buf = bytearray(64)
    struct.pack_into("Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    except OSError:
        return None
    if not struct.unpack_from("Q", buf, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    return struct.unpack_from("i", buf, 60)[0]


def _exit_status(pid: int, pidfd: int | None) -> tuple[str, int]:
    """("signal", n), ("exit", status) or ("unknown", 0) for a rank whose pipe has closed: from
    ``/proc/<pid>/stat`` until the parent reaps it, then from the pidfd where the kernel keeps
    it."""
    for _ in range(10):
        s = _stat(pid)
        code = int(s[49]) if s is not None and len(s) >= 50 else _reaped_status(pidfd)
        if code is not None:
            return ("signal", code & 0x7F) if code & 0x7F else ("exit", code >> 8)
        time.sleep(0.002)
    return "unknown", 0


def _dying(pid: int) -> tuple[bool, bool]:
    """(not healthy, exited normally) for a peer: dead, exiting, or a kill signal pending."""
    s = _stat(pid)
    if s is None:
        return True, False
    code = int(s[49]) if len(s) >= 50 else 0
    if s[0] in "ZXx" or code:
        return True, not code & 0x7F
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd", "ShdPnd")):
                    if int(line.split()[1], 16) & (1 << (9 - 1) | 1 << (15 - 1)):  # KILL, TERM
                        return True, False
    except (OSError, ValueError):
        return True, False
    return False, False


def _children(parent: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{parent}/task"):
            with open(f"/proc/{parent}/task/{tid}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        pass
    return kids


# -- the rank's side ------------------------------------------------------------------------

def _env_int(names) -> int | None:
    for n in names:
        v = os.environ.get(n, "")
        if v.isdigit():
            return int(v)
    return None


def start(rank: int) -> None:
    """Start this rank's watcher (once; nothing when turned off or the job spans hosts)."""
    global _fd, _parent, _proc
    local, world = _env_int(_LOCAL_VARS), _env_int(_WORLD_VARS)
    if (_fd is not None or os.environ.get(ENV) == "0" or local is None or local != world
            or not sys.platform.startswith("linux")):
        return
    import subprocess

    _parent = os.getppid()
    r, w = os.pipe()
    host = os.environ.get("PMI_HOSTNAME") or os.uname().nodename
    try:  # (the watcher leaves the rank's session itself: start_new_session would forbid vfork)
        _proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(r),
                                  str(os.getpid()), str(rank), str(_parent), str(local), host],
                                 pass_fds=(r,), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL)
    except OSError:
        os.close(w)
        return
    finally:
        os.close(r)
    _fd = w
    os.register_at_fork(after_in_child=_forget)


def _forget() -> None:
    """A forked child must not keep the pipe open (its parent's death would go unseen)."""
    global _fd
    if _fd is not None:
        try:
            os.close(_fd)
        except OSError:
            pass
        _fd = None


def mark_clean() -> None:
    """Tell the watcher this rank is leaving through Python's exit path."""
    _tell(CLEAN)


def note_segments() -> None:
    """Tell the watcher the MPI library's shared-memory files this rank maps (after MPI's
    init), for it to remove should the rank die outside Python."""
    if _fd is None:
        return
    for path in mpi_segments():
        _tell(b"F " + path.encode(errors="surrogateescape"))


def _tell(line: bytes) -> None:
    """One line to the watcher (shorter than PIPE_BUF: written whole)."""
    if _fd is not None:
        try:
            os.write(_fd, line + b"\n")
        except OSError:
            pass


def mpi_segments(pid: int | str = "self") -> list:
    """The MPI library's shared-memory files (:data:`SEGMENT_PREFIXES`) process ``pid`` maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            fields = [ln.split(None, 5) for ln in f]
    except OSError:
        return []
    return sorted({f[5].strip() for f in fields
                   if len(f) == 6 and f[5].startswith(SEGMENT_PREFIXES)})


def remove_segments(paths) -> None:
    """Unlink ``paths`` on the way out of the job (the ranks on this node map the same files,
    and running ranks' mappings stay valid until they end)."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def claim(reason: str) -> None:
    """Before the runtime aborts the job with its own report: silence every watcher."""
    if _fd is None:
        return
    d = job_dir(_parent)
    try:
        os.makedirs(d, exist_ok=True)
        fd = os.open(os.path.join(d, "claim"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, reason.encode(errors="replace")[:200])
        os.close(fd)
    except OSError:
        pass


# -- the watcher's side -----------------------------------------------------------------------

def _purge_stale(mine: str) -> None:
    """Remove other jobs' directories whose process manager is gone."""
    base = os.path.dirname(mine)
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid, _, start = name.partition("-")
        d = os.path.join(base, name)
        if d != mine and pid.isdigit() and _start_time(int(pid)) != start:
            try:
                for f in os.listdir(d):
                    os.unlink(os.path.join(d, f))
                os.rmdir(d)
            except OSError:
                pass


def _read_records(d: str) -> list[tuple]:
    """(time of death, rank, peers were healthy, watcher started late, not the process
    manager's SIGKILL) of each record."""
    recs = []
    for name in os.listdir(d):
        if name.startswith("dead."):
            try:
                with open(os.path.join(d, name)) as f:
                    t, rank, healthy, late, own = f.read().split()
                recs.append((float(t), int(rank), healthy == "1", late == "1", own == "1"))
            except (OSError, ValueError):
                pass
    return recs


def _describe(kind: str, num: int) -> str:
    if kind == "signal":
        import signal

        try:
            return f"was killed by signal {num} ({signal.Signals(num).name})"
        except ValueError:
            return f"was killed by signal {num}"
    if kind == "exit":
        return f"exited with status {num} outside Python's exit path (os._exit or a C exit)"
    return ("died outside Python's exit path: killed by a signal or crashed (or os._exit); its "
            "exit status was collected before it could be read")


def watch(fd: int, pid: int, rank: int, parent: int, local: int, host: str) -> None:
    os.setsid()  # out of the rank's process group, which the process manager kills
    d = job_dir(parent)
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    late = _dying(pid)[0]  # the rank died before this watcher was ready: no time of death
    buf, segments = b"", []
    while True:
        b = os.read(fd, 4096)
        if not b:
            break
        *lines, buf = (buf + b).split(b"\n")
        for line in lines:
            if line == CLEAN:  # the rank is on Python's exit path: leave now, not at its end
                return
            if line.startswith(b"F "):
                segments.append(line[2:].decode(errors="surrogateescape"))
    t = time.monotonic()
    remove_segments(segments)  # the job is ending: MPI_Finalize will not run
    kind, num = _exit_status(pid, pidfd)
    # the process manager stops the other ranks with SIGKILL: any other known death is a cause
    own = kind == "exit" or (kind == "signal" and num != 9)
    claim_path = os.path.join(d, "claim")
    if os.path.exists(claim_path):
        return
    peers = [p for p in _children(parent) if p != pid]
    states = [_dying(p) for p in peers]
    healthy_peers = sum(not s[0] for s in states) == local - 1
    parent_alive = (_stat(parent) or ["Z"])[0] not in "ZXx"
    peer_exited = any(s[1] for s in states)
    _purge_stale(d)
    try:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"tmp.{rank}")
        with open(tmp, "w") as f:
            f.write(f"{t!r} {rank} {int(healthy_peers)} {int(late)} {int(own)}\n")
        os.rename(tmp, os.path.join(d, f"dead.{rank}"))
    except OSError:
        return
    # wait GRACE s (and up to 1 s more for every rank's record), noting peers that exit normally
    while time.monotonic() < t + GRACE or (len(_read_records(d)) < local
                                           and time.monotonic() < t + GRACE + 1):
        time.sleep(0.005)
        peer_exited = peer_exited or any(_dying(p)[1] for p in peers)
    recs = _read_records(d)
    if os.path.exists(claim_path) or not recs or any(r[3] for r in recs):
        return
    # the first to die among deaths not by SIGKILL (a segfault, an exit), if any: one whose
    # peers were all healthy then, else the earliest record
    causes = [r for r in recs if r[4]] or recs
    first = min([r for r in causes if r[2]] or causes)
    if (first[1] != rank or not parent_alive or (kind == "exit" and num == 0)
            or (kind != "signal" and peer_exited)):
        return
    try:
        os.close(os.open(claim_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        return
    others = sorted(r[1] for r in recs if r[1] != rank)
    stopped = "" if local == 1 else \
        f"; {f'ranks {others}' if others else 'the other ranks'} were stopped because of it"
    os.write(2, (f"[disttensor] job aborted: rank {rank} (pid {pid} on host {host}) "
                 f"{_describe(kind, num)}{stopped}\n").encode(errors="replace"))


if __name__ == "__main__":
    a = sys.argv[1:]
    try:
        watch(int(a[0]), int(a[1]), int(a[2]), int(a[3]), int(a[4]), a[5])
    except Exception:  # a watcher never outlives its rank, whatever happens
        pass
