"""What an MPI job does when something goes wrong: it ends, and says which rank did what.

Installed by ``import collectives`` in a process started under MPI (nothing happens otherwise):

- **Unhandled exception** (any thread, before or after ``init()``): the lowest rank failing with
  a given error prints its traceback, the others one line naming that rank; then
  ``MPI_Abort(1)``. ``faulthandler`` is on, so a segfault leaves the Python stack in the log.
- **Exit**: ``sys.exit(s)`` with ``s != 0`` aborts the job at once with status ``s``. Any other
  exit (status 0, return from the script, ``raise SystemExit``) tells every other rank "rank k
  exited", then waits at exit for the others (as ``MPI_Finalize`` would). A rank blocked in a
  collective whose group holds an exited rank aborts with a report naming both.
- **Headers** (:mod:`collectives._headers`): members of a group agree on every call's
  sequence number, kind and byte count before any data moves; members in different calls raise
  :func:`mismatch_error` (naming every member's call and call site) instead of pairing.
- **Watchdog**: every collective records (group, name, metadata, call index, start time, caller
  frame) on entry — one tuple — and clears it on return. A daemon thread wakes every ``POLL``
  s and answers other ranks' questions (where is this rank: in which collective, or outside any,
  at which line). While a collective has been blocked for ``stall_after()`` s
  (``DISTTENSOR_STALL_TIMEOUT``, default 5) it asks every rank where it is: a member in the
  same call with other metadata, a member gone past the call, an exited member, or a deadlock
  (:mod:`collectives._stall`) ends the job with a report naming every rank's state and call
  site; members merely late are waited for until ``timeout()`` s (``DISTTENSOR_TIMEOUT``,
  default 600, or ``init_parallel_env(timeout=...)``), and the report then says where each of
  them is.

- **Death outside Python** (SIGKILL, segfault, ``os._exit``): no hook runs in the dying rank,
  so each rank has a watcher process (:mod:`collectives._watcher`) that names it under plain
  ``mpiexec``; the runtime's aborts claim the job first so that watchers stay silent.

Every report starts with ``[disttensor] job aborted: rank K ...`` naming the rank to blame
(``launch`` reads that line).
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time
import traceback
from typing import Any, Optional

from . import _watcher
from ._headers import SEQ_SHIFT, decode
from ._stall import MARK, describe, diagnose, state_line

TIMEOUT_ENV = "DISTTENSOR_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
STALL_ENV = "DISTTENSOR_STALL_TIMEOUT"
DEFAULT_STALL = 5.0
POLL = 0.2
REPLY_WAIT = 1.0  # s a stalled rank waits for the others' answers before judging
_TAG_EXIT, _TAG_PROBE, _TAG_FAIL, _TAG_STATE, _TAG_SITE = 9101, 9102, 9103, 9104, 9105


class Watch:
    """The collective in flight on this process (``now``), set and cleared by ProcessGroup."""

    now: Optional[tuple] = None  # (group, name, sig, index, t0, caller frame)


def _parse_timeout(value: Any, where: str) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}={value!r} must be a number of seconds") from None
    if not t > 0:
        raise ValueError(f"{where}={value!r} must be > 0 seconds")
    return t


_timeout = _parse_timeout(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT, TIMEOUT_ENV)
_stall = _parse_timeout(os.environ.get(STALL_ENV) or DEFAULT_STALL, STALL_ENV)


def timeout() -> float:
    """Seconds a collective may stay blocked before the watchdog aborts the job."""
    return _timeout


def set_timeout(seconds: float) -> None:
    global _timeout
    _timeout = _parse_timeout(seconds, "timeout")


def stall_after() -> float:
    """Seconds a collective stays blocked before its rank asks the others where they are."""
    return min(_stall, _timeout / 2)


# -- reports ------------------------------------------------------------------------------------

def _internal_dirs() -> tuple[str, ...]:
    dirs = []
    for name in ("collectives", "disttensor", "spmd_rules"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)) + os.sep)
    return tuple(dirs)


def call_site(frame) -> str:
    """``file:line in func`` of the first frame outside the runtime's packages (and outside
    the code it generates, whose file names start with ``<disttensor``), plus a hint when the
    collective was issued by ``Tensor.numpy()``."""
    dirs = _internal_dirs()
    hint = ""
    f = frame
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(dirs) and not f.f_code.co_filename.startswith("<disttensor"):
            site = f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
            return site + hint
        if f.f_code.co_name == "numpy" and fn.endswith(os.path.join("distributed", "api.py")):
            hint = " (through Tensor.numpy(), which is a collective: every rank of the " \
                   "tensor's mesh must call it)"
        f = f.f_back
    return "?" + hint


def _write(text: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, (text if text.endswith("\n") else text + "\n").encode(errors="replace"))


def abort(text: str, code: int = 1) -> None:
    """Print ``text``, give the process manager a moment to forward it, remove the MPI
    library's shared-memory files on this node, end the whole job."""
    try:
        _watcher.claim(text.strip().splitlines()[-1] if text.strip() else "abort")
        _write(text)
        time.sleep(0.2)
    finally:
        try:
            from mpi4py import MPI  # (MPI's init maps its shared-memory files, if not yet)
            _watcher.remove_segments(_watcher.mpi_segments())
            MPI.COMM_WORLD.Abort(code)
        finally:
            os._exit(code)


# -- the control channel --------------------------------------------------------------------

class Control:
    """Small pickled messages between ranks on a private communicator: exit notices, questions
    and answers about where a rank is (probes), call sites of mismatched calls, failure
    notices. Used only when something is already wrong or at exit, never on the fast path."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.lock = threading.Lock()
        self.exited: dict[int, Any] = {}
        self.probes: dict[tuple, dict[int, tuple]] = {}  # (ranks, index) -> {rank: call}
        self.failed: dict[int, str] = {}
        self.asked: list = []  # [(rank, group ranks, ask)] of probes awaiting this rank's state
        self.states: dict[int, tuple] = {}  # rank -> (group ranks, ask, state): latest answer
        self.sites: dict[tuple, dict[int, tuple]] = {}  # (ranks, index) -> mismatched calls
        self._reqs: list = []

    def send_all(self, ranks, tag: int, obj) -> None:
        with self.lock:
            for r in ranks:
                if r != self.rank:
                    self._reqs.append(self.comm.isend(obj, dest=r, tag=tag))
            if len(self._reqs) > 64:
                self._reqs = [q for q in self._reqs if not q.Test()]

    def drain(self) -> None:
        from mpi4py import MPI
        st = MPI.Status()
        with self.lock:
            while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st):
                src, tag = st.Get_source(), st.Get_tag()
                msg = self.comm.recv(source=src, tag=tag)
                if tag == _TAG_EXIT:
                    self.exited[src] = msg
                elif tag == _TAG_PROBE:  # (ranks, index, name, sig, site, ask): where src waits
                    self.probes.setdefault(msg[:2], {})[src] = msg[2:5]
                    self.asked.append((src, msg[0], msg[5]))
                elif tag == _TAG_STATE:  # (ranks, ask, state): the answer to a probe
                    state = msg[2]
                    self.states[src] = msg
                    if state[0] == "in":
                        self.probes.setdefault(state[1:3], {})[src] = state[3:6]
                elif tag == _TAG_SITE:
                    self.sites.setdefault(msg[:2], {})[src] = msg[2:]
                elif tag == _TAG_FAIL:
                    self.failed[src] = msg

    def answer(self) -> None:
        """Tell the ranks that asked where this rank is (see :mod:`collectives._stall`)."""
        while self.asked:
            with self.lock:
                asked, self.asked = self.asked, []
            for src, ranks, ask in asked:
                self.send_all((src,), _TAG_STATE, (ranks, ask, my_state(ranks)))

    def finish_sends(self) -> None:
        from mpi4py import MPI
        with self.lock:
            MPI.Request.Waitall(self._reqs)
            self._reqs = []


def _issued(ranks: tuple) -> int:
    """Calls this process has issued on the group of ``ranks`` (0 if it has none)."""
    g = getattr(sys.modules.get("collectives"), "_groups", {}).get(ranks)
    return g._call_index if g is not None else 0


def my_state(ranks: tuple) -> tuple:
    """This rank's state for the stall probe of a member of the group of ``ranks``."""
    cur = Watch.now
    if cur is not None:
        group, name, sig, index, t0, frame = cur
        return ("in", group.ranks, index, name, sig, call_site(frame),
                time.monotonic() - t0, _issued(ranks))
    frame = sys._current_frames().get(threading.main_thread().ident)
    return ("out", "?" if frame is None else call_site(frame), _issued(ranks))


def mismatch_error(group, cur: tuple, row, h: int) -> Exception:
    """The error every member raises when the header table shows members in different calls
    (``row``: the table's row of this call, ``h`` this rank's header): it names each
    member's call and call site (exchanged over the failure channel, waiting up to 5 s) and
    blames the minority call, the side that went through ``Tensor.numpy()`` on a tie."""
    from ._common import CollectiveMismatchError
    _, name, sig, index, _, frame = cur
    ranks, me, seq = group.ranks, group.ranks[group.rank], h >> SEQ_SHIFT
    site = call_site(frame)
    calls = {me: (name, sig, site)}
    c = _control
    if c is not None:
        c.send_all(ranks, _TAG_SITE, (ranks, index, name, sig, site))
        end = time.monotonic() + 5.0  # (it ends as soon as every member has told)
        while time.monotonic() < end:
            c.drain()
            posted = [ranks[i] for i, w in enumerate(row.tolist()) if w and w >> SEQ_SHIFT == seq]
            calls.update(c.sites.get((ranks, index), {}))
            if all(r in calls for r in posted):
                break
            time.sleep(0.01)
    heads = {ranks[i]: w for i, w in enumerate(row.tolist()) if w and w >> SEQ_SHIFT == seq}
    kinds = list(heads.values())
    blame = min(heads, key=lambda r: (kinds.count(heads[r]),
                                      "Tensor.numpy()" not in calls.get(r, ("", "", ""))[2], r))
    lines = "\n".join(
        f"  rank {r}: {describe(*calls[r][:2], index, ranks)}, called from {calls[r][2]}"
        if r in calls else f"  rank {r}: {decode(w)} (call site not reported)"
        for r, w in sorted(heads.items()))
    err = CollectiveMismatchError(
        f"rank {blame} called a different collective than other ranks of group {list(ranks)} "
        f"as call #{index}; no data was exchanged (ranks not listed have not arrived):\n{lines}")
    err.failing_ranks = [blame]
    return err


_control: Optional[Control] = None
_watchdog: Optional["Watchdog"] = None


class Watchdog(threading.Thread):
    """Answers other ranks' probes; aborts the job when the collective in flight is blocked
    past the timeout, is mismatched with a member's call, waits for a rank that has exited or
    gone past it, or is part of a deadlock."""

    def __init__(self, control: Control):
        super().__init__(name="disttensor-watchdog", daemon=True)
        self.control = control
        self.stopped = threading.Event()
        self._probed = None  # (group, index, t0) of the call last probed for, and when
        self._asked_at = 0.0
        self._ask = 0  # probes sent (answers name the probe they answer)
        self._mismatch: dict = {}
        self._errors: set = set()

    def run(self) -> None:
        while not self.stopped.wait(POLL):
            try:
                self.control.drain()
                self.control.answer()
                cur = Watch.now
                if cur is not None and time.monotonic() - cur[4] >= POLL:
                    self.check(cur)
            except Exception as e:  # pragma: no cover - a broken watchdog must not go silent
                if repr(e) not in self._errors:  # (once per error: it wakes 5 times a second)
                    self._errors.add(repr(e))
                    _write(f"[disttensor] watchdog error on rank {self.control.rank}: {e!r}")
            # the call's frame keeps its callers' locals alive: never hold it while waiting
            cur = None

    def check(self, cur: tuple) -> None:
        group, name, sig, index, t0, frame = cur
        c = self.control
        me = c.rank
        now = time.monotonic()
        waited = now - t0
        what = describe(name, sig, index, group.ranks)
        gone = [r for r in group.ranks if r in c.exited]
        if gone:
            k = gone[0]
            st = c.exited[k]
            abort(f"{MARK} {k} exited (status {st}) while rank {me} waits in {what}, called "
                  f"from {call_site(frame)}; rank {k} will never join it")
        peers = c.probes.get((group.ranks, index), {})
        calls = {me: (name, sig, call_site(frame)), **peers}
        if any(v[:2] != (name, sig) for v in calls.values()):
            # wait up to a second for every member's probe, then blame the minority call
            # (on a tie, the side that went through Tensor.numpy(), else the other side)
            first = self._mismatch.setdefault(id(cur), now)
            if len(calls) == len(group.ranks) or now - first > 1.0:
                kinds = [v[:2] for v in calls.values()]
                def weight(r):
                    return (kinds.count(calls[r][:2]), "Tensor.numpy()" not in calls[r][2], r == me)
                blame = min(calls, key=weight)
                lines = "\n".join(f"  rank {r}: {describe(n, sg, index, group.ranks)}, called "
                                  f"from {site}" for r, (n, sg, site) in sorted(calls.items()))
                abort(f"{MARK} {blame} called a different collective than other ranks of group "
                      f"{list(group.ranks)} as call #{index} (ranks not listed have not "
                      f"arrived):\n{lines}")
        if waited < stall_after():
            return
        key = (group.ranks, index, t0)
        if self._probed != key or now - self._asked_at >= max(stall_after(), REPLY_WAIT + 3):
            # ask every rank where it is (members compare calls; the others answer too)
            self._probed, self._asked_at, self._ask = key, now, self._ask + 1
            c.send_all(range(c.size), _TAG_PROBE, (group.ranks, index, name, sig,
                                                   call_site(frame), self._ask))
            return
        states = {r: s for r, (ranks, ask, s) in c.states.items()
                  if ranks == group.ranks and ask == self._ask}  # this round's answers
        states[me] = my_state(group.ranks)
        if len(states) == c.size or now - self._asked_at >= REPLY_WAIT:
            verdict = diagnose(me, states, now - self._asked_at)
            # one report: the lowest rank concerned gives it, the others only if it does not
            if verdict is not None and (me <= min(verdict[2]) or
                                        now - self._asked_at >= REPLY_WAIT + 2):
                abort(verdict[1])
        # one report: the lowest rank in the call gives it, the others only if it does not
        arrived = sorted(set(peers) | {me})
        if waited >= _timeout + (0 if me == arrived[0] else 2):
            latest = {r: s for r, (ranks, _, s) in c.states.items() if ranks == group.ranks}
            states = {**latest, **states}
            missing = [r for r in group.ranks if r not in arrived]
            blame = self.root_cause(missing, states) if missing else me
            lines = "\n".join("  " + state_line(r, states.get(r)) for r in range(c.size))
            abort(f"{MARK} {blame} did not arrive: rank {me} has been blocked "
                  f"{waited:.1f} s (timeout {_timeout:g} s, {TIMEOUT_ENV}) in {what}, called "
                  f"from {call_site(frame)}; ranks of the group in this call: {arrived}; "
                  f"never arrived: {missing}; what each rank is doing:\n{lines}")

    @staticmethod
    def root_cause(missing: list, states: dict) -> int:
        """The first rank reached from ``missing`` that is not itself blocked in a collective
        (following each blocked rank to the members its own call is waiting for)."""
        seen, todo = set(), list(missing)
        while todo:
            r = todo.pop(0)
            if r in seen:
                continue
            seen.add(r)
            st = states.get(r)
            if st is None or st[0] != "in":
                return r
            todo += [m for m in st[1] if m != r and not (
                states.get(m) is not None and states[m][:3] == st[:3])]
        return missing[0]


def start(world_comm) -> None:
    """Called by ``collectives.init()`` under MPI: the control channel and the watchdog."""
    global _control, _watchdog
    if _control is not None:
        return
    _control = Control(world_comm.Dup())
    _watchdog = Watchdog(_control)
    _watchdog.start()


def mpi_started() -> None:
    """Called by ``collectives.init()`` once MPI is initialized, before its first collective:
    the watcher learns MPI's shared-memory files, to remove should this rank die."""
    _watcher.note_segments()


# -- exits and unhandled exceptions ---------------------------------------------------------------

_exit_status: Any = None
_installed = False


def _world_rank() -> int:
    for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if v in os.environ:
            try:
                return int(os.environ[v])
            except ValueError:
                pass
    return -1


def _status_code(status: Any) -> int:
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    return 1  # sys.exit("message") prints it and exits 1


def _recording_exit(status: Any = None):
    """``sys.exit`` that remembers its status for the exit hook."""
    global _exit_status
    _exit_status = status
    raise SystemExit(status)


def _on_exception(text: str, summary: str, failing_ranks=None) -> None:
    """Print the traceback once (lowest failing rank with this error), then abort. An error
    that knows which ranks caused it (``failing_ranks``, e.g. a metadata disagreement raised on
    every rank) names the first of them as the rank to blame."""
    me = _world_rank()
    blame = failing_ranks[0] if failing_ranks else me
    c = _control
    if c is not None:
        c.send_all(range(c.size), _TAG_FAIL, summary)
        end = time.monotonic() + 0.3  # let ranks failing with the same error say so
        while time.monotonic() < end:  # (draining also progresses our own sends)
            c.drain()
            time.sleep(0.01)
        same = sorted(r for r, s in c.failed.items() if s == summary and r < me)
        if same:
            abort(f"[disttensor] rank {me}: aborted; rank {same[0]} failed with the same error "
                  f"({summary})")
    abort(f"{text}{MARK} {blame}: unhandled exception on rank {me} ({summary})")


def _sys_hook(etype, value, tb) -> None:
    text = "".join(traceback.format_exception(etype, value, tb))
    _on_exception(text, "".join(traceback.format_exception_only(etype, value)).strip(),
                  getattr(value, "failing_ranks", None))


def _thread_hook(args) -> None:
    if args.exc_type is SystemExit:
        return
    name = getattr(args.thread, "name", "?")
    text = f"in thread {name}:\n" + "".join(
        traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    _on_exception(text, "".join(
        traceback.format_exception_only(args.exc_type, args.exc_value)).strip())


def _at_exit() -> None:
    """Exit protocol (see the module docstring)."""
    code = _status_code(_exit_status)
    me = _world_rank()
    if code != 0:
        abort(f"{MARK} {me} exited with status {code} (sys.exit)", code)
    if _control is None:  # exiting before init(): join the world so the others can be told
        import collectives
        collectives.init()
    c = _control
    if _watchdog is not None:
        _watchdog.stopped.set()
        _watchdog.join(timeout=2 * POLL + 1)
    c.send_all(range(c.size), _TAG_EXIT, "0" if _exit_status is None else repr(_exit_status))
    req = c.comm.Ibarrier()
    while not req.Test():
        c.drain()
        time.sleep(0.005)
    c.drain()
    c.finish_sends()
    _watcher.mark_clean()


def is_rank_process() -> bool:
    """False in a subprocess that merely inherited an MPI rank's environment: the process
    manager's connection (``PMI_FD``) is not open there, and such a process must never abort or
    join the parent's job."""
    fd = os.environ.get("PMI_FD")
    if fd is None:
        return True
    try:
        os.fstat(int(fd))
    except (OSError, ValueError):
        return False
    return True


def install() -> None:
    """Install the hooks (idempotent); called by ``import collectives`` under MPI."""
    global _installed
    if _installed or not is_rank_process():
        return
    _installed = True
    faulthandler.enable(all_threads=True)
    _watcher.start(_world_rank())
    sys.excepthook = _sys_hook
    threading.excepthook = _thread_hook
    sys.exit = _recording_exit
    atexit.register(_at_exit)
