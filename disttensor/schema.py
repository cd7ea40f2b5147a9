"""The static op schema: one :class:`OpDef` per op, registered by one call (the analogue of
Paddle's ``ops.yaml`` entries), and the registry of public functions and Tensor methods.

An :class:`OpDef` says everything the runtime needs to know about an op before running it:

* ``kernel(xp, *arrays, **attrs)`` — written once against the array module ``xp`` (numpy or
  cupy); returns one array or a tuple of ``n_out`` arrays. ``needs_ctx`` kernels also take
  ``ctx`` (a :class:`KernelCtx`); ``accepts_out`` kernels take ``out=`` (an array of the
  result's shape and dtype to write into, or None);
* ``backward(node, *out_grads)`` — one grad (or None) per input, built from registered ops so it
  dispatches like the forward;
* ``rule`` — the name of its SPMD rule in :mod:`spmd_rules` (checked when the op registers);
  None for ops that never see a distributed input through the rules: creation ops, and the
  entry points that build their own plans (``reshard``, ``shard_tensor``, ...);
* ``dtype(in_dtypes, attrs)`` — the output dtypes, so no kernel ever runs to learn them;
* ``view`` — ``(input, output)`` pairs: the output shares the input's buffer and version
  counter (output ``-1``: every output, for ``split``); ``view_if(shape, strides, attrs)`` of
  the array the kernel reads makes the view conditional (``reshape``: a view exactly when the
  strides allow, else a copy);
* ``inplace`` — the ``(input, output)`` pairs of the ``op_`` variant: the output is written
  into the input, which is returned itself with its version bumped;
* ``mutates`` — ``(input, output)`` pairs the op *always* writes in place (optimizer updates,
  batch_norm's running statistics): that output is the input tensor itself, same holder, same
  version counter (bumped);
* ``reuse`` — inputs whose buffer the kernel may write its output into when the input dies
  there (inplace reuse; the memory planner uses it);
* ``no_need_buffer`` — inputs whose backward needs only the shape (Paddle's no_need_buffer);
* ``recompute`` — the kernel is cheap and deterministic: a captured step may run it again in the
  backward instead of keeping its output alive (rematerialization, :mod:`disttensor.jit.remat`);
* ``local_attrs(attrs, in_metas, out_metas, coord)`` — attributes given in global terms
  (reshape's target shape, slice bounds) converted to this rank's local terms.

:func:`public` registers the public functions (``dt.<name>``) and Tensor methods in
:data:`API` and :data:`METHODS`; :mod:`disttensor.ops` exports the first and
:mod:`disttensor.tensor_methods` binds the second.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from spmd_rules import RULES, rule_coverage

from .dtype import bfloat16, float32_compute, is_floating, promote_floating

__all__ = ["OpDef", "OPS", "register", "KernelCtx", "DENSE_CTX", "API", "METHODS", "public",
           "coverage_report", "AMP_CLASSES",
           "same_dtype", "promote_dtypes", "fixed_dtype", "attr_dtype", "ufunc_dtype",
           "DtypeMismatch", "paddle_promote", "promoting", "equal_dtypes"]


# -- dtype inference ------------------------------------------------------------------------

DtypeRule = Callable[[Sequence[Any], dict], tuple]


def promote_dtypes(dtypes: Sequence[Any], attrs: dict) -> tuple:
    """numpy's result type of the present inputs (the default); with bfloat16 among floating
    inputs, Paddle's floating promotion (numpy has no common type for bfloat16 and float16)."""
    ds = [np.dtype(d) for d in dtypes if d is not None]
    if bfloat16 in ds and all(is_floating(d) for d in ds):
        return (functools.reduce(promote_floating, ds),)
    return (np.result_type(*ds),)


class DtypeMismatch(TypeError):
    """Raised by a dtype rule that refuses its inputs' dtypes (the op adds its name)."""


def _mismatch(ds, why: str):
    names = ", ".join(f"input {i}: {np.dtype(d).name}" for i, d in enumerate(ds) if d is not None)
    raise DtypeMismatch(f"inputs of different dtypes ({names}); {why}")


def promoting(rule: DtypeRule) -> DtypeRule:
    """``rule`` behind Paddle's Tensor-Tensor promotion check: inputs of one dtype, or floating
    dtypes only (float16 + float32 -> float32: the larger one); any other mix (int with float,
    int32 with int64, bool with int) is refused — cast one input first. Python scalars are not
    Tensors here: the public functions give them a dtype by Paddle's Tensor-Scalar rule first."""
    def check(dtypes, attrs):
        ds = [np.dtype(d) for d in dtypes if d is not None]
        if any(d != ds[0] for d in ds) and not all(is_floating(d) for d in ds):
            _mismatch(dtypes, "Paddle promotes only between floating dtypes; cast one input "
                              "first")
        return rule(dtypes, attrs)
    check.strict = True
    return check


#: the Tensor-Tensor rule of the arithmetic ops (add, subtract, multiply, maximum, ...)
paddle_promote = promoting(promote_dtypes)


def equal_dtypes(dtypes: Sequence[Any], attrs: dict) -> tuple:
    """One dtype for every present input, which is the output's (matmul, concat, stack:
    Paddle and PyTorch refuse mixed dtypes there)."""
    ds = [np.dtype(d) for d in dtypes if d is not None]
    if any(d != ds[0] for d in ds):
        _mismatch(dtypes, "this op needs one dtype for all inputs; cast one input first")
    return (ds[0],)


equal_dtypes.strict = True


def same_dtype(i: int = 0, n_out: int = 1) -> DtypeRule:
    """Every output has input ``i``'s dtype."""
    return lambda dtypes, attrs: (np.dtype(dtypes[i]),) * n_out


def fixed_dtype(*dts: Any) -> DtypeRule:
    """Fixed output dtypes (``bool`` for comparisons, ``int64`` for argmax, ...)."""
    out = tuple(np.dtype(d) for d in dts)
    return lambda dtypes, attrs: out


def ufunc_dtype(ufunc) -> DtypeRule:
    """The result dtype numpy's ``ufunc`` resolves for the inputs (exp of int64 is float64)."""
    def rule(dtypes, attrs):
        ins = tuple(np.dtype(d) for d in dtypes if d is not None)
        return (ufunc.resolve_dtypes(ins + (None,) * ufunc.nout)[-1],)
    return rule


def attr_dtype(name: str = "dtype") -> DtypeRule:
    """The dtype given by attribute ``name`` (cast, full, full_like, creation ops)."""
    return lambda dtypes, attrs: (np.dtype(attrs[name]),)


# -- kernel context -------------------------------------------------------------------------

class KernelCtx:
    """What a ``needs_ctx`` kernel may ask about the global tensor its inputs are pieces of.

    This dense version answers for a single process (whole arrays, nothing to reduce); the
    distributed planner prepares one that answers for this rank's pieces.
    """

    def allreduce(self, arr, op: str, input_index: int, axes: tuple[int, ...]):
        """Reduce ``arr`` across the ranks that hold other pieces of ``axes`` of input
        ``input_index`` (identity here)."""
        return arr

    def offset(self, input_index: int, axis: int) -> int:
        """Global index of this piece's first element along ``axis`` of input ``input_index``."""
        return 0

    def global_shape(self, input_index: int, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The global shape of input ``input_index`` (given its local shape)."""
        return tuple(local_shape)

    def is_split(self, input_index: int, axis: int) -> bool:
        """Whether ``axis`` of input ``input_index`` is split across ranks (alike on every rank,
        unlike a comparison of the local and global sizes: a rank may hold all of a split axis)."""
        return False

    def collectives(self) -> list[str]:
        """The collectives this context may issue (for printing plans)."""
        return []


DENSE_CTX = KernelCtx()


# -- the op schema --------------------------------------------------------------------------

Pairs = tuple[tuple[int, int], ...]


@dataclass(eq=False)
class OpDef:
    """One op's static schema (see the module docstring)."""

    name: str
    kernel: Callable | None
    backward: Callable | None = None
    rule: str | None = "replicated"
    n_out: int = 1
    dtype: DtypeRule = promote_dtypes
    save_inputs: tuple[int, ...] = ()
    save_outputs: tuple[int, ...] = ()
    view: Pairs = ()
    view_if: Callable | None = None
    inplace: Pairs = ()
    mutates: Pairs = ()
    reuse: tuple[int, ...] = ()
    accepts_out: bool = False
    no_need_buffer: tuple[int, ...] = ()
    nondiff_outputs: frozenset = frozenset()
    # extra attrs for the rule: a dict, or a function of the op's attrs returning one
    rule_attrs: dict | Callable = field(default_factory=dict)
    # inputs that may carry gradients (None = all floating inputs); used by the grad checks
    grad_inputs: tuple[int, ...] | None = None
    needs_ctx: bool = False
    # the kernel draws from the global generator (ranks outside the mesh draw too)
    random: bool = False
    recompute: bool = False
    local_attrs: Callable | None = None
    # autocast class: "white" (runs in low precision), "black" (runs in float32), "promote"
    # (runs in the widest floating input dtype) or None (as called); default: AMP_CLASSES
    amp: str | None = None
    # filled in by the dispatcher: the cached dense plans of this op, and the plain one
    plans: dict = field(default_factory=dict, repr=False)
    plan0: Any = field(default=None, repr=False)

    @property
    def differentiable(self) -> bool:
        return self.backward is not None

    def __post_init__(self) -> None:
        # the dtype rule may refuse its inputs: dense calls consult it too
        self.strict_dtypes: bool = getattr(self.dtype, "strict", False)
        if self.amp is None:
            self.amp = AMP_CLASSES.get(self.name)
        if self.amp not in (None, "white", "black", "promote"):
            raise ValueError(f"register: op {self.name!r}: amp must be 'white', 'black', "
                             f"'promote' or None, got {self.amp!r}")

    def out_dtypes(self, dtypes: Sequence[Any], attrs: dict, shapes: Sequence[Any] = ()
                   ) -> tuple:
        """The output dtypes for inputs of ``dtypes`` (None for absent inputs); a refused
        mix raises TypeError naming the op (and the input ``shapes`` when given)."""
        try:
            return tuple(np.dtype(d) for d in self.dtype(dtypes, attrs))
        except DtypeMismatch as e:
            where = f" (shapes {[None if s is None else list(s) for s in shapes]})" \
                if shapes else ""
            raise TypeError(f"{self.name}: {e}{where}") from None

    def view_source(self, slot: int) -> int | None:
        """The input whose buffer output ``slot`` views, if any."""
        for i, o in self.view:
            if o == slot or o == -1:
                return i
        return None

    def mutated_input(self, slot: int) -> int | None:
        """The input that output ``slot`` is (updated in place), if any."""
        for i, o in self.mutates:
            if o == slot:
                return i
        return None


OPS: dict[str, OpDef] = {}

#: the autocast class of ops that do not name one (``register(..., amp=...)`` overrides): the
#: white list runs in float16/bfloat16 under ``dt.amp.auto_cast``, the black list in float32
#: (statistics, exponentials and reductions lose too much in 8 mantissa bits), "promote" ops
#: need one dtype and take the widest of their floating inputs
AMP_CLASSES: dict[str, str] = {
    **dict.fromkeys(("matmul", "linear", "bmm", "conv1d", "conv2d", "conv3d",
                     "scaled_dot_product_attention", "flash_attention"), "white"),
    **dict.fromkeys(("softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy",
                     "cross_entropy_mean", "sum", "mean", "exp", "log", "pow"), "black"),
    **dict.fromkeys(("concat", "stack"), "promote"),
}


def register(name: str, kernel: Callable | None, **spec: Any) -> OpDef:
    """Register op ``name`` with the fields of :class:`OpDef` (one call per op; ``kernel`` None
    for the entry points that plan themselves) and return its OpDef.
    The rule name must be a registered SPMD rule; pairs must name existing inputs/outputs."""
    if name in OPS:
        raise ValueError(f"register: op {name!r} is already registered")
    rule = spec.get("rule", "replicated")
    if rule is not None and rule not in RULES:
        raise ValueError(f"register: op {name!r} names SPMD rule {rule!r}, which does not "
                         f"exist; known rules: {sorted(RULES)}")
    n_out = spec.get("n_out", 1)
    for key in ("inplace", "mutates"):
        for i, o in spec.get(key, ()):
            if n_out != -1 and not 0 <= o < n_out:
                raise ValueError(f"register: op {name!r}: {key} pair ({i}, {o}) names output "
                                 f"{o}, but the op has {n_out} output(s)")
    op = OPS[name] = OpDef(name=name, kernel=None if kernel is None else float32_compute(
        kernel, name, spec, spec.get("dtype", promote_dtypes)), **spec)
    return op


# -- public functions and Tensor methods -------------------------------------------------------

#: public function name -> function (exported as ``disttensor.<name>``)
API: dict[str, Callable] = {}
#: Tensor method or operator name -> function(self, ...)
METHODS: dict[str, Callable] = {}


def public(name: str | None = None, *, methods: Sequence[str] | bool = (),
           rmethods: Sequence[str] = (), export: bool = True):
    """Decorator registering a public function: ``disttensor.<name>`` (unless ``export`` is
    False) and the Tensor methods ``methods`` (``True``: a method of the same name) and reflected
    operators ``rmethods`` (``__radd__``: ``f(other, self)``)."""
    def deco(fn: Callable) -> Callable:
        n = name or fn.__name__
        if export:
            if n in API and API[n] is not fn:
                raise ValueError(f"public: {n!r} is already registered")
            API[n] = fn
        for m in ((n,) if methods is True else tuple(methods or ())):
            METHODS[m] = fn
        for m in rmethods:
            METHODS[m] = _reflected(fn)
        return fn
    return deco


def _reflected(fn: Callable) -> Callable:
    def reflected(self, other):
        return fn(other, self)
    reflected.__name__ = f"r{fn.__name__}"
    return reflected


def coverage_report() -> dict[str, list[str]]:
    """Which registered ops have a real SPMD rule (``"rule"``) and which use the replicated
    fallback (``"fallback"``); creation ops and the entry points that plan themselves (rule
    None) are not listed."""
    return rule_coverage({name: op.rule for name, op in OPS.items() if op.rule is not None})
