"""Errors that mean "the user's input is wrong": printed without a traceback, exit code 2."""


class UserError(Exception):
    """A problem with the user's input; printed without a traceback, exit code 2."""


MAX_PROBLEMS_SHOWN = 12


class ScenarioError(ValueError):
    """A scenario that cannot be used; `problems` holds one line per offending field."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"{source}: " if source else ""
        if len(problems) == 1:
            super().__init__(f"{head}{problems[0]}")
        else:        # 20,000 unknown keys must not print megabytes: the first few, then a count
            shown = [f"  - {p}" for p in problems[:MAX_PROBLEMS_SHOWN]]
            if len(problems) > MAX_PROBLEMS_SHOWN:
                shown.append(f"  ... and {len(problems) - MAX_PROBLEMS_SHOWN:,} more")
            lines = "\n".join(shown)
            super().__init__(f"{head}{len(problems)} problems:\n{lines}")


class SweepError(ValueError):
    """A sweep, or a run of many points, that cannot run as asked; the message names the flag and
    what is allowed."""
