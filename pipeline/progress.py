"""Progress lines a person can trust: stage, done/total, rate and ETA, at least every N seconds.

A long loop (teacher and DP-student steps, generated samples, teacher-cache batches,
distillation steps, evaluation windows) calls `ProgressLog.update` after each unit of work.
The first update is logged (the stage is alive: a person can tell a slow run from a hung
one), then at most one line every `every` seconds, and the last one:

    teacher: 12/300 steps (4%), 0.213 steps/s, ε=1.230, replace-one ε=1.876, elapsed 56s, ETA 22m 31s

Lines go to the stage's stdlib logger (`pipeline.*`), which flows/ routes into Prefect's
run logs (terminal and UI); nothing here imports Prefect. A line shows only what the caller
passes: the DP stages pass steps and ε, never a private batch's size or token count (with
Poisson sampling they are functions of the records drawn). Tokens/s are for public text
(synthetic samples) only.

A DP stage's step *durations* are private too (they track the Poisson batch size), and every
line's timestamp publishes one: with `window=W` lines come only at multiples of W units and at
the end, so a reader learns the time of W steps at once, never of one (issue 21).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

DEFAULT_EVERY = 30.0  # seconds between progress lines (PipelineConfig.progress_seconds)


def format_duration(seconds: float | None) -> str:
    """'42s', '3m 05s', '1h 02m', '2d 03h'; 'unknown' when there is no estimate yet."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "unknown"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def format_rate(count: float, seconds: float, unit: str) -> str:
    """`count` units in `seconds` as '0.213 steps/s', '4.56 samples/s', '1234 tokens/s'."""
    if seconds <= 0:
        return f"? {unit}/s"
    rate = count / seconds
    if rate >= 100:
        shown = f"{rate:.0f}"
    elif rate >= 10:
        shown = f"{rate:.1f}"
    elif rate >= 1:
        shown = f"{rate:.2f}"
    else:
        shown = f"{rate:.3g}"
    return f"{shown} {unit}/s"


def eta_seconds(done: int, total: int, made: int, elapsed: float) -> float | None:
    """Seconds left at the rate so far: `made` units (done in this run, not resumed ones) in
    `elapsed` seconds, `total - done` to go. None before the first unit."""
    if done >= total:
        return 0.0
    if made <= 0 or elapsed <= 0:
        return None
    return (total - done) * elapsed / made


def progress_line(
    stage: str, done: int, total: int, unit: str, *, made: int, elapsed: float, seconds: float | None = None,
    counts: dict[str, float] | None = None, values: dict[str, str] | None = None,
) -> str:
    """One progress line: `made` units (and `counts` of further units, shown as rates:
    'tokens' -> 'tokens/s') in `seconds` (default `elapsed`) give the rate and the ETA;
    `values` are shown as given ('ε' -> 'ε=1.23')."""
    seconds = elapsed if seconds is None else seconds
    pct = 100 * done // max(total, 1)
    parts = [f"{stage}: {done}/{total} {unit} ({pct}%)", format_rate(made, seconds, unit)]
    parts += [format_rate(n, seconds, name) for name, n in (counts or {}).items()]
    parts += [f"{name}={value}" for name, value in (values or {}).items()]
    parts += [f"elapsed {format_duration(elapsed)}", f"ETA {format_duration(eta_seconds(done, total, made, seconds))}"]
    return ", ".join(parts)


class ProgressLog:
    """Throttled progress lines for one loop of `total` units, starting at `done` (a resumed
    run: the rate and ETA count only the units made from here). `started`: when the work
    began, if before this object (a clock() value); default now.

    From the second line on, the rate and ETA count from the first update: start-up before
    the first unit (loading models, starting Dask workers: minutes on a busy machine) would
    otherwise make the early ETAs far too long. `elapsed` still counts from `started`.

    `window`: lines only when `done` is a multiple of it, or at the end (the timing of a DP
    stage's steps: see the module's docstring); the `every` throttle applies on top.
    """

    def __init__(
        self, logger: logging.Logger | logging.LoggerAdapter, stage: str, unit: str, total: int, *,
        every: float = DEFAULT_EVERY, done: int = 0, clock: Callable[[], float] = time.monotonic,
        started: float | None = None, window: int = 1,
    ):
        assert window >= 1, window
        self.logger, self.stage, self.unit, self.total, self.every = logger, stage, unit, total, every
        self.window = window
        self.start, self.clock = done, clock
        self.t0 = clock() if started is None else started
        self._last: float | None = None  # when the last line was logged
        self._last_done: int | None = None
        self._first: tuple[float, int, dict[str, float]] | None = None  # (time, made, counts) at the first line

    def skipped(self, n: int) -> None:
        """`n` units were done without work (reused from an earlier run): not in the rate."""
        self.start += n

    def due(self, done: int) -> bool:
        """Whether `update(done)` logs a line: the first update, the last, or `every` s since
        the previous line, and only at a multiple of `window` (or the end). Lets a caller
        compute a costly value (ε) only for a logged line."""
        if done % self.window and done < self.total:
            return False
        if self._last is None or self.clock() - self._last >= self.every:
            return True
        return done >= self.total and done != self._last_done  # the end, once

    def update(self, done: int, *, counts: dict[str, float] | None = None,
               values: dict[str, str] | None = None) -> bool:
        """Log a line if one is due; returns whether it did."""
        if not self.due(done):
            return False
        now = self._last = self.clock()
        self._last_done = done
        made, counts = done - self.start, counts or {}
        if self._first is None:
            self._first = (now, made, dict(counts))
        t1, made1, counts1 = self._first
        if made > made1 and now > t1:  # the rate since the first unit, start-up left out
            rate_made, seconds = made - made1, now - t1
            counts = {name: n - counts1.get(name, 0) for name, n in counts.items()}
        else:
            rate_made, seconds = made, now - self.t0
        self.logger.info("%s", progress_line(self.stage, done, self.total, self.unit, made=rate_made,
                                             elapsed=now - self.t0, seconds=seconds, counts=counts, values=values))
        return True


def on_batch_lines(logger: logging.Logger | logging.LoggerAdapter, stage: str, unit: str,
                   every: float = DEFAULT_EVERY) -> Callable[[int, int], None]:
    """An `on_batch(done, total)` callback that logs throttled progress lines, for a loop whose
    total is known only at its first batch; timed from when the callback is made."""
    lines, started = None, time.monotonic()

    def on_batch(done: int, total: int) -> None:
        nonlocal lines
        if lines is None:
            lines = ProgressLog(logger, stage, unit, total, every=every, started=started)
        lines.update(done)

    return on_batch
