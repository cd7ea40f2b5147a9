"""Program capture (DESIGN §8): the trace hook :func:`record`."""
from .record import record

__all__ = ["record"]
