"""The small models the user-layer tests place and compare with numpy."""
from __future__ import annotations

import disttensor.nn.functional as F
from disttensor import nn


class TwoLayer(nn.Layer):
    """fc1 -> relu -> fc2 (the names the plans in these tests refer to)."""

    def __init__(self, din: int = 6, hidden: int = 10, dout: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(din, hidden)
        self.fc2 = nn.Linear(hidden, dout)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))
