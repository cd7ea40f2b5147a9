"""Pipeline parallelism: schedules as action tables and the eager schedules that run them."""
from __future__ import annotations

from .schedules import (SCHEDULES, Action, bubble_fraction, schedule_actions, schedule_table,
                        simulate, theoretical_bubble)

__all__ = ["SCHEDULES", "Action", "bubble_fraction", "schedule_actions", "schedule_table",
           "simulate", "theoretical_bubble"]
