"""examples/train.py --pp with dropout, eager and captured (--to-static): after 5 steps the
losses and the parameters equal the un-pipelined dense run over the same micro-batches
(``--dense --accumulate M``: the same dropout masks, drawn in the same order).

Not bitwise: float32 gradients are summed in another order (the data-parallel all-reduce adds
the ranks' partial sums, the dense run the rows at once). The losses agree to 1e-6 relative
(measured: below 1e-7), the parameters to 5e-6 of their norm (measured: up to 1.2e-6). Not
elementwise: AdamW divides a gradient by its running magnitude, so a near-zero gradient element
rounded differently moves its parameter by a good part of the step size. The attention's key
bias is left out: softmax ignores a constant added to a row of scores, so its gradient is zero
up to rounding, and AdamW turns that noise into full-size steps in any two runs that round
differently."""
import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.mpi

COMMON = ["--model", "gpt", "--steps", "5", "--log-interval", "100", "--dropout", "0.1"]
_DENSE: dict = {}


def _layouts(n: int) -> list[list[str]]:
    """--pp (and --mesh) for this world size: pp x dp, pp alone and pp x mp at 4 ranks."""
    if n == 4:
        return [["--pp", "2"], ["--pp", "4"], ["--pp", "2", "--mesh", "1,2"]]
    return [["--pp", str(n)]]


def _params(path: str, layers: int) -> dict:
    """The parameters a --save checkpoint holds, read into the dense GPT."""
    model, opt, _ = train.build("gpt", 2026, None, layers=layers, dropout=0.1)
    train.resume(os.path.join(path, "gpt"), model, opt)
    return {n: p.numpy() for n, p in model.named_parameters()}


def _run(argv: list[str], path: str, layers: int):
    losses = train.main(COMMON + argv + ["--save", path])["gpt"]
    return losses, _params(path, layers)


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "VPP"])
@pytest.mark.parametrize("m", [4, 8])
def test_pipelined_gpt_with_dropout_equals_dense_run(schedule, m, tmp_path_factory, comm):
    n = collectives.init().size
    if n == 1:
        pytest.skip("a pipeline needs two ranks")
    root = comm.bcast(str(tmp_path_factory.mktemp("pp_drop")) if comm.rank == 0 else None)
    for k, layout in enumerate(_layouts(n)):
        pp = int(layout[1])
        mb = m if m % pp == 0 or schedule != "VPP" else 2 * pp
        size = ["--layers", str(2 * pp), "--batch", str(4 * mb)]
        key = (2 * pp, mb)
        if key not in _DENSE:
            _DENSE[key] = _run(size + ["--dense", "--accumulate", str(mb)],
                               os.path.join(root, f"dense{k}"), 2 * pp)
        want_losses, want_params = _DENSE[key]
        for mode in ([], ["--to-static"]):
            what = " ".join(layout + mode)
            losses, params = _run(size + layout + mode + [
                "--micro-batches", str(mb), "--schedule", schedule],
                os.path.join(root, f"pp{k}{len(mode)}"), 2 * pp)
            np.testing.assert_allclose(losses, want_losses, rtol=1e-6, err_msg=what)
            kept = {k: w for k, w in want_params.items() if not k.endswith("attn.k.bias")}
            diff = np.concatenate([(params[k] - w).ravel() for k, w in kept.items()])
            norm = np.linalg.norm(np.concatenate([w.ravel() for w in kept.values()]))
            worst = max(kept, key=lambda k: np.max(np.abs(params[k] - kept[k])))
            if dt.get_rank() == 0:
                print(f"[pp-dropout] {what} {schedule} m={mb}: loss rel "
                      f"{np.max(np.abs(np.array(losses) / want_losses - 1)):.2e}, params rel "
                      f"{np.linalg.norm(diff) / norm:.2e}, max abs {np.max(np.abs(diff)):.2e}")
            assert np.linalg.norm(diff) <= 5e-6 * norm, f"{what}: parameters differ ({worst})"
