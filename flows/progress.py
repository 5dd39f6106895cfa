"""Progress of a long stage: a Prefect progress artifact, and a bar in a terminal.

The library calls `on_progress(info)` with `done`/`total` and aggregates (ε so far, add/remove and
replace-one, the teacher's validation loss, the distillation loss, tokens/s); nothing here ever
sees a record.
The artifact's updates are timestamped by the server: a DP stage passes `window`
(pipeline.stages.teacher.TIMING_WINDOW_STEPS) so that none comes between two multiples of it.
"""

from __future__ import annotations

import sys
import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from tqdm import tqdm

_SHOWN = ("loss", "validation_loss", "epsilon", "epsilon_replace_one", "kl", "tokens_per_second", "samples")


class StageProgress:
    """Callable progress hook; updates the artifact at most every `every` seconds, and the
    artifact and the bar only when `done` is a multiple of `window` or the end."""

    def __init__(self, stage: str, unit: str, every: float = 2.0, window: int = 1):
        self.stage, self.unit, self.every, self.window = stage, unit, every, window
        self.artifact_id = create_progress_artifact(
            progress=0.0, key=f"{stage}-progress", description=f"{stage}: {unit} done, in percent"
        )
        self.bar: tqdm | None = None
        self._last = 0.0

    def __call__(self, info: dict) -> None:
        done, total = info["done"], max(info["total"], 1)
        if done % self.window and done < total:
            return  # a DP step's duration is private: nothing shows when one step ended
        if self.bar is None and sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=self.stage, unit=self.unit, leave=False, file=sys.stderr)
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix({k: f"{info[k]:.4g}" for k in _SHOWN if isinstance(info.get(k), (int, float))},
                                 refresh=False)
            self.bar.refresh()
        now = time.monotonic()
        if done >= total or now - self._last >= self.every:
            self._last = now
            update_progress_artifact(self.artifact_id, progress=100.0 * done / total)

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        update_progress_artifact(self.artifact_id, progress=100.0)
