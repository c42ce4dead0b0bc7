"""Continuous batching: the scheduler, preemption, the plan of one step (SchedulerOutput) and how a step's
results update its sequences."""
