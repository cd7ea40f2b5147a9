"""``with disttensor.jit.record() as calls:`` — every call executed inside the block, in order.

Each entry is a :class:`disttensor.plan.CallRecord`: the plan that ran (its instructions:
reshard steps, the kernel, write-backs), the attrs, the input and output tensors; ``print(call)``
shows the op, the inputs' and outputs' global shapes, dtypes and placements and the collectives
the call issued (PyTorch users know this as CommDebugMode). Nothing that creates, moves or
mutates a tensor escapes it: every such path passes the dispatcher's one seam."""
from __future__ import annotations

from ..dispatch import Observer, add_observer, remove_observer
from ..plan import CallRecord

__all__ = ["record", "Recording"]


class Recording(list):
    """The list of :class:`CallRecord` a :func:`record` block collected."""

    def collectives(self) -> list[str]:
        """Every collective issued inside the block, as printable lines."""
        return [f"{c.op}: {line}" for c in self for line in c.collectives]

    def __str__(self) -> str:
        return "\n".join(f"{i:4d}  {c}" for i, c in enumerate(self))


class record(Observer):
    """Context manager collecting the :class:`CallRecord` of every call made inside it."""

    def __init__(self) -> None:
        self.calls = Recording()

    def on_call(self, call: CallRecord) -> None:
        self.calls.append(call)

    def __enter__(self) -> Recording:
        add_observer(self)
        return self.calls

    def __exit__(self, *exc) -> bool:
        remove_observer(self)
        return False
