"""The scheduler's counters, as the metrics read them (read-only views of its parts)."""

from __future__ import annotations


class SchedulerMetrics:
    """Mixed into Scheduler: every counter here reads the scheduler's own parts (preemption,
    results, spec, swapped), so nothing is counted twice."""

    num_preemptions = property(lambda self: self.preemption.num_preemptions)
    num_generated = property(lambda self: self.results.num_generated)  # output tokens the last update kept
    preemptions_by_mode = property(lambda self: self.preemption.by_mode)
    num_swap_fallbacks = property(lambda self: self.preemption.num_swap_fallbacks)
    num_draft_tokens = property(lambda self: self.spec.num_draft_tokens if self.spec else 0)
    num_drafts = property(lambda self: self.spec.num_drafts if self.spec else 0)  # (sequence, step) pairs
    num_accepted_tokens = property(lambda self: self.spec.num_accepted_tokens if self.spec else 0)
    # requests with at least one sequence swapped out (metric num_requests_swapped)
    num_requests_swapped = property(lambda self: len({s.request.request_id for s in self.swapped}))
