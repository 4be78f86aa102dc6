"""The fast paths beside the reference policy (sim/core/scheduler.py): exact shortcuts, never
approximations. `cohort`: steady decodes advanced one token per step in O(1); `leap`: a stretch of
pure decode steps scheduled and priced in one go; `counting_pool`: a block pool that names only the
blocks the prefix cache maps. docs/architecture_core.md explains why each is exact;
tests/core/test_differential.py compares every prediction with the one-by-one path."""
