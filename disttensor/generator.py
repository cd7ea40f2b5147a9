"""The global seeded generator (``dt.seed``) behind rand/randn/uniform, initializers and
dropout's masks. Kernels of random ops draw from it when they run, so a captured program that
replays them advances it exactly as eager execution does; every rank seeded alike draws the same
numbers."""
from __future__ import annotations

import numpy as np

__all__ = ["Generator", "default_generator"]


class Generator:
    """A numpy ``Generator`` with the seed it was made from."""

    def __init__(self, seed: int = 0):
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> "Generator":
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)
        return self

    def next_seed(self) -> int:
        """A fresh 62-bit seed (for counter-based masks such as dropout's)."""
        return int(self.rng.integers(0, 2**62))


default_generator = Generator(0)
