"""Program capture: the trace hook :func:`record`, :func:`to_static` /
:class:`DistModel` and the captured :class:`Program` (forward/backward split, inplace chains,
replay) and its memory plan (liveness, arena, verifier)."""
from .buffers import peak_bytes, verify
from .capture import CaptureError, DistModel, StaticFunction, to_static
from .program import Program
from .record import record

__all__ = ["record", "to_static", "StaticFunction", "DistModel", "CaptureError", "Program",
           "peak_bytes", "verify"]
