"""The fast paths beside the reference policy (sim/core/scheduler.py): exact shortcuts, never
approximations. `cohort`: steady decodes advanced one token per step in O(1); `leap`: a stretch of
pure decode steps scheduled and priced in one go. docs/architecture_core.md explains why each is
exact; tests/core/test_differential.py compares every prediction with the one-by-one path."""
