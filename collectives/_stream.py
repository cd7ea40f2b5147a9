"""numba's streaming row copy for :mod:`._shared` (imported only where numba is installed).

Each 16-byte piece is stored with LLVM's ``!nontemporal`` hint (``movntps`` on x86), bytes up to
the destination's next 16-byte boundary and after the last whole piece by ordinary stores; a
sequentially consistent fence at the end orders the streamed stores before whatever tells a peer
the rows have landed.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _stream16(typingctx, dst, src, d, s):
    """16 bytes of the uint8 array ``src`` from byte ``s`` into ``dst`` (16-byte aligned at
    byte ``d``), stored non-temporally."""
    def codegen(context, builder, signature, args):
        dst_v, src_v, d_v, s_v = args
        da = context.make_array(signature.args[0])(context, builder, dst_v)
        sa = context.make_array(signature.args[1])(context, builder, src_v)
        vec = ir.VectorType(ir.IntType(64), 2).as_pointer()
        value = builder.load(builder.bitcast(builder.gep(sa.data, [s_v]), vec), align=1)
        store = builder.store(value, builder.bitcast(builder.gep(da.data, [d_v]), vec), align=16)
        store.set_metadata("nontemporal",
                           builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
    return types.void(dst, src, d, s), codegen


@intrinsic
def _fence(typingctx):
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
    return types.void(), codegen


@njit(cache=True, boundscheck=False)
def stream_rows(dst, dpos, src, spos, rows, run, stride):
    """``rows`` runs of ``run`` bytes ``stride`` apart in ``src`` from ``spos``, one after
    another into ``dst`` from ``dpos`` (``dst``'s data 16-byte aligned)."""
    for i in range(rows):
        d = dpos + i * run
        s = spos + i * stride
        end = d + run
        while d < end and d % 16:
            dst[d] = src[s]
            d += 1
            s += 1
        while d + 16 <= end:
            _stream16(dst, src, d, s)
            d += 16
            s += 16
        while d < end:
            dst[d] = src[s]
            d += 1
            s += 1
    _fence()
