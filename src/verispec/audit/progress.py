"""Progress reporting for the audit: a rich progress bar on stderr, plain lines (logs, CI),
or nothing (tests). Each has `stage(description, total)` (a context manager yielding a
task with `advance(n)`), `check_done(check)` and `close()`."""

from __future__ import annotations

import contextlib
import sys


class _NullTask:
    def advance(self, n: int = 1) -> None:
        pass


class NullProgress:
    @contextlib.contextmanager
    def stage(self, description: str, total: int):
        yield _NullTask()

    def check_done(self, check) -> None:
        pass

    def close(self) -> None:
        pass


def _check_line(check) -> str:
    mark = "INFO" if check.informational else ("PASS" if check.passed else "FAIL")
    return f"{mark} {check.name:<20} {check.elapsed_s:7.1f} s  {check.summary}"


class PlainProgress(NullProgress):
    """No bars: a line per finished check on stderr."""

    def check_done(self, check) -> None:
        print(_check_line(check), file=sys.stderr, flush=True)


class RichProgress:
    """One bar per stage (a batch of engine runs or an analysis), and a line per finished
    check with its verdict and elapsed time."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn)
        self.console = Console(stderr=True)
        self._bar = Progress(SpinnerColumn(), TextColumn("{task.description:<34}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(), console=self.console,
                             transient=True)
        self._bar.start()

    @contextlib.contextmanager
    def stage(self, description: str, total: int):
        task_id = self._bar.add_task(description, total=max(total, 1))
        bar = self._bar

        class _Task:
            def advance(self, n: int = 1) -> None:
                bar.advance(task_id, n)

        try:
            yield _Task()
        finally:
            self._bar.remove_task(task_id)

    def check_done(self, check) -> None:
        from rich.markup import escape
        line = _check_line(check)
        style = "cyan" if check.informational else ("green" if check.passed else "bold red")
        self.console.print(f"[{style}]{line[:4]}[/]{escape(line[4:])}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        self._bar.stop()
