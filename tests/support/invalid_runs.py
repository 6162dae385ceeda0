"""Chaos quick tests whose run was invalid: the skip they take and the session's tally of them.

A quick chaos test that judges goodput, lost users or hung clients needs a valid run (its load
generator kept its schedule); on a machine too busy for that it is skipped, not passed. Such a
test carries the ``needs_valid_run`` mark and skips with :func:`invalid_run_reason`.
``tests/conftest.py`` feeds every report to an :class:`InvalidRuns`, prints its
:meth:`~InvalidRuns.summary_line` at the end of the session, and fails the session when
:meth:`~InvalidRuns.all_invalid`: a build whose runs are always invalid must not pass silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

__all__ = ["INVALID_RUN_PREFIX", "NEEDS_VALID_RUN", "InvalidRuns", "InvalidRunsReport",
           "invalid_run_reason"]

INVALID_RUN_PREFIX = "chaos quick run invalid"
NEEDS_VALID_RUN = "needs_valid_run"


def invalid_run_reason(warning: str) -> str:
    """The skip reason of a test whose run was invalid, with the generator's own warning."""
    return f"{INVALID_RUN_PREFIX} (the load generator could not keep its schedule): {warning}"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@dataclass
class InvalidRuns:
    """The ``needs_valid_run`` tests of one session: which were judged, which skipped invalid."""

    num_judged: int = 0  # passed or failed: their run was valid
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node id, reason)

    def record(self, report: pytest.TestReport) -> None:
        if NEEDS_VALID_RUN not in report.keywords:
            return
        if report.when == "call" and not report.skipped:
            self.num_judged += 1
        elif report.skipped and _skip_reason(report).startswith(INVALID_RUN_PREFIX):
            self.skipped.append((report.nodeid, _skip_reason(report)))

    def all_invalid(self) -> bool:
        """Every test that needed a valid run skipped because its run was invalid."""
        return bool(self.skipped) and self.num_judged == 0

    def summary_line(self) -> str | None:
        """One line for the terminal summary; None when no such test skipped."""
        if not self.skipped:
            return None
        names = ", ".join(node.split("::", 1)[-1] for node, _ in self.skipped)
        verdict = ("every one of them: FAILED (a run that is always invalid must not pass)"
                   if self.all_invalid() else f"{self.num_judged} judged on a valid run")
        return (f"{len(self.skipped)} chaos quick runs were invalid and skipped: {names}; "
                f"{verdict}; first reason: {self.skipped[0][1]}")


class InvalidRunsReport:
    """The pytest plugin: tallies every report, prints the line, fails an all-invalid session."""

    def __init__(self) -> None:
        self.runs = InvalidRuns()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.runs.record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.runs.all_invalid() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        line = self.runs.summary_line()
        if line is not None:
            terminalreporter.section("chaos quick runs", red=self.runs.all_invalid())
            terminalreporter.write_line(line)
