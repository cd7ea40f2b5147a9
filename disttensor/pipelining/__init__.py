"""Pipeline parallelism: schedules as action tables and the eager schedules that run them
over a model :func:`disttensor.parallelize` cut into stages (``pp_config``)."""
from __future__ import annotations

from .eager import PipelineSchedule, Schedule1F1B, ScheduleFThenB, ScheduleVPP
from .schedules import (
    SCHEDULES,
    Action,
    bubble_fraction,
    schedule_actions,
    schedule_table,
    simulate,
    theoretical_bubble,
)

__all__ = ["SCHEDULES", "Action", "bubble_fraction", "schedule_actions", "schedule_table",
           "simulate", "theoretical_bubble", "PipelineSchedule", "ScheduleFThenB",
           "Schedule1F1B", "ScheduleVPP"]
