"""Progress a person can trust (issue 10): every long stage logs done/total, rate and ETA
after its first step or batch and then at least every `progress_every` seconds; generation
reports per batch, not per shard; the DP teacher's lines hold steps, ε and times only, and
come only every TIMING_WINDOW_STEPS steps (a step's duration is private, issue 21)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from contextlib import contextmanager

import pytest
import torch

import flows.progress
from flows.generation import _read_shard_progress, generation_shard_task
from pipeline.config import DistillConfig, EvalConfig, GenerateConfig, TeacherConfig
from pipeline.stages.distill import distill
from pipeline.stages.evaluate import evaluate_models
from pipeline.stages.generate import generate_synthetic, plan_generation
from pipeline.models.base import load_causal_lm
from pipeline.progress import ProgressLog, eta_seconds, format_duration, format_rate, progress_line
from pipeline.stages.teacher.monitor import TIMING_WINDOW_STEPS
from pipeline.stages.teacher.recipe import train_teacher

CODES = {"Category: A\tStars: 5": 6, "Category: B\tStars: 1": 3, "Category: C": 1}


@contextmanager
def captured(logger_name: str):
    """The messages logged to `logger_name` (and below) while inside, whatever handlers
    Prefect's logging config put on the `pipeline` logger."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger, handler = logging.getLogger(logger_name), Keep(level=logging.INFO)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# --- the pure helpers --------------------------------------------------------------------

def test_durations_and_rates_read_like_a_person_would_write_them():
    assert [format_duration(s) for s in (0, 42.4, 65, 3599, 3720, 90000)] == [
        "0s", "42s", "1m 05s", "59m 59s", "1h 02m", "1d 01h"]
    assert format_duration(None) == format_duration(float("inf")) == "unknown"
    assert format_rate(3, 14.1, "steps") == "0.213 steps/s"
    assert format_rate(45, 10, "samples") == "4.50 samples/s"
    assert format_rate(123, 10, "samples") == "12.3 samples/s"
    assert format_rate(12345, 10, "tokens") == "1234 tokens/s"  # no exponent notation
    assert format_rate(5, 0, "steps") == "? steps/s"


def test_eta_counts_only_the_units_made_in_this_run():
    assert eta_seconds(done=10, total=110, made=10, elapsed=20) == 200  # 2 s a unit, 100 to go
    # resumed at 50: 10 made in 20 s, 50 to go -> 100 s, not (110-60)/60*20
    assert eta_seconds(done=60, total=110, made=10, elapsed=20) == 100
    assert eta_seconds(done=0, total=10, made=0, elapsed=5) is None  # nothing to extrapolate yet
    assert eta_seconds(done=10, total=10, made=10, elapsed=5) == 0
    line = progress_line("teacher", 12, 300, "steps", made=12, elapsed=56.3,
                         values={"ε": "1.230", "replace-one ε": "1.876"})
    assert line == ("teacher: 12/300 steps (4%), 0.213 steps/s, ε=1.230, replace-one ε=1.876, elapsed 56s, "
                    "ETA 22m 31s")  # 288 steps at 56.3 s / 12


def test_lines_are_throttled_but_the_first_and_last_always_shown():
    now = [0.0]
    with captured("pipeline.test_progress") as lines:
        log = ProgressLog(logging.getLogger("pipeline.test_progress"), "stage", "steps", 10, every=30,
                          clock=lambda: now[0])
        for step in range(1, 11):
            now[0] += 10  # a step every 10 s: a line every third step
            log.update(step)
        log.update(10)  # the end reported again (a shard's last batch, then the shard): one line
    assert [int(re.match(r"stage: (\d+)/10", line).group(1)) for line in lines] == [1, 4, 7, 10]
    assert lines[-1].endswith("ETA 0s")


def test_a_windowed_log_publishes_times_only_at_multiples_of_the_window():
    """Issue 21: with a step every 2 s and no throttle, a 45-step log with window 20 says
    something (a line, hence a timestamp) at steps 20, 40 and 45 only, each rate an average
    over the window, never over one step."""
    now = [0.0]
    with captured("pipeline.test_progress") as lines:
        log = ProgressLog(logging.getLogger("pipeline.test_progress"), "teacher", "steps", 45, every=0,
                          clock=lambda: now[0], window=20)
        for step in range(1, 46):
            now[0] += 2.0 if step % 2 else 8.0  # uneven steps: only their sums may show
            assert log.due(step) == (step in (20, 40, 45))
            log.update(step)
    assert [int(re.match(r"teacher: (\d+)/45", line).group(1)) for line in lines] == [20, 40, 45]
    assert "0.2 steps/s" in lines[0]  # 20 steps in 100 s, from the start
    assert "0.2 steps/s" in lines[1]  # 20 steps in 100 s since the first line
    assert lines[2].endswith("elapsed 3m 42s, ETA 0s")  # steps 41-45 end with the stage (public anyway)


def test_the_teacher_progress_artifact_moves_only_at_multiples_of_the_window(monkeypatch):
    """Prefect timestamps each artifact update: the teacher's come every 20 steps and at the end."""
    updates = []
    monkeypatch.setattr(flows.progress, "create_progress_artifact", lambda **kw: "artifact")
    monkeypatch.setattr(flows.progress, "update_progress_artifact",
                        lambda artifact_id, progress: updates.append(round(progress)))
    progress = flows.progress.StageProgress("teacher", "steps", every=0, window=TIMING_WINDOW_STEPS)
    for step in range(1, 46):
        progress({"done": step, "total": 45})
    assert updates == [round(100 * 20 / 45), round(100 * 40 / 45), 100]


def test_the_teacher_progress_bar_shows_both_epsilons(monkeypatch):
    """Issue 38 item 6: the bar showed the add/remove ε only."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(flows.progress, "create_progress_artifact", lambda **kw: "artifact")
    monkeypatch.setattr(flows.progress, "update_progress_artifact", lambda artifact_id, progress: None)
    monkeypatch.setattr(flows.progress.sys, "stderr", Terminal())
    progress = flows.progress.StageProgress("teacher", "steps", every=0, window=TIMING_WINDOW_STEPS)
    progress({"done": 20, "total": 45, "epsilon": 1.234, "epsilon_replace_one": 1.876})
    assert "epsilon=1.234" in progress.bar.postfix and "epsilon_replace_one=1.876" in progress.bar.postfix
    progress.close()


def test_rate_and_eta_leave_out_the_start_up_before_the_first_unit():
    """Dask workers took minutes to start on a busy machine: the ETA after it was 2 h 45 m for
    a 3-minute generation. From the second line on, the rate counts from the first unit."""
    now = [100.0]  # 100 s of start-up (models, workers) before the first sample
    with captured("pipeline.test_progress") as lines:
        log = ProgressLog(logging.getLogger("pipeline.test_progress"), "generation", "samples", 40, every=0,
                          clock=lambda: now[0], started=0.0)
        log.update(4, counts={"tokens": 40})
        now[0] = 110.0
        log.update(24, counts={"tokens": 240})  # 20 samples, 200 tokens in 10 s
    assert lines[0] == "generation: 4/40 samples (10%), 0.04 samples/s, 0.4 tokens/s, elapsed 1m 40s, ETA 15m 00s"
    assert lines[1] == "generation: 24/40 samples (60%), 2.00 samples/s, 20.0 tokens/s, elapsed 1m 50s, ETA 8s"


# --- the stages ----------------------------------------------------------------------------

TEACHER_LINE = re.compile(  # everything a teacher progress line may say: steps, ε (both adjacencies) and times
    r"teacher: (\d+)/(\d+) steps \(\d+%\), [\d.?]+ steps/s, ε=([\d.]+), replace-one ε=([\d.]+), "
    r"elapsed [\dmhd ]+s?, ETA [\w ]+")


def test_teacher_logs_steps_rate_epsilon_and_eta_every_window_never_a_batch_size(
    splits, tiny_model_dir, tmp_path
):
    cfg = TeacherConfig(target_epsilon=3.0, epochs=3, batch_size=10, physical_batch_size=10, max_length=48,
                        log_every=3)
    with captured("pipeline.stages.teacher") as messages:
        result = train_teacher(cfg, train_path=splits.train, validation_path=splits.validation,
                               base_model=str(tiny_model_dir), out_dir=tmp_path, seed=0, progress_every=0)
    lines = [m for m in messages if "steps/s" in m]
    steps = result.ledger.steps
    assert TIMING_WINDOW_STEPS < steps < 2 * TIMING_WINDOW_STEPS
    # An interval of ~0, yet lines only at the window and the end: no single step's duration
    assert [int(TEACHER_LINE.fullmatch(line).group(1)) for line in lines] == [TIMING_WINDOW_STEPS, steps]
    for line in lines:
        m = TEACHER_LINE.fullmatch(line)
        assert m, line  # nothing else: no tokens, no batch size (private under Poisson sampling)
        assert int(m.group(2)) == steps
    # The last line's ε is the ledger's, under both adjacencies (issue 38 item 6)
    m = TEACHER_LINE.fullmatch(lines[-1])
    assert (m.group(3), m.group(4)) == (f"{result.ledger.epsilon:.3f}", f"{result.ledger.epsilon_replace_one:.3f}")
    assert not re.search(r"token|batch|records", " ".join(lines))
    timed = [re.match(r"teacher: step (\d+)/\d+ ε=[\d.]+, replace-one ε=[\d.]+ \(", m) for m in messages]
    assert [int(m.group(1)) for m in timed if m] == [TIMING_WINDOW_STEPS, steps]  # log_every's line, with seconds
    # issue 9 settled what training_log.json holds; progress lines add nothing to it, and
    # its seconds come at the window too, while ε follows log_every; no validation loss at all
    # under the default teacher.monitor=none (issue 21: it was computed from private records)
    history = json.loads((tmp_path / "training_log.json").read_text())["history"]
    assert all(set(h) <= {"step", "epsilon", "epsilon_replace_one", "seconds"} for h in history)
    assert [h["step"] for h in history if "seconds" in h] == [TIMING_WINDOW_STEPS, steps]
    assert {3, 6, 9} <= {h["step"] for h in history if "epsilon" in h}
    assert all(h["epsilon"] < h["epsilon_replace_one"] for h in history if "epsilon" in h)
    assert history[-1]["epsilon_replace_one"] == pytest.approx(result.ledger.epsilon_replace_one)
    assert not any("validation" in m for m in messages)


@pytest.fixture
def codes_path(tmp_path):
    path = tmp_path / "control_codes.json"
    path.write_text(json.dumps({"columns": ["label1", "label2"], "private": False, "note": "", "counts": CODES}))
    return path


def test_generation_reports_every_batch_of_a_single_shard(tiny_model_dir, codes_path, tmp_path):
    cfg = GenerateConfig(num_samples=24, shard_size=24, batch_size=6, max_length=24, validation_fraction=0.2)
    updates: list[dict] = []
    with captured("pipeline.stages.generate") as messages:
        result = generate_synthetic(cfg, teacher_dir=tiny_model_dir, control_codes_path=codes_path, ledger=[],
                                    out_dir=tmp_path / "synthetic", seed=3, on_progress=updates.append,
                                    progress_every=0)
    assert len(result.shards) == 1
    done = [u["done"] for u in updates]
    assert done == sorted(done) and done[-1] == 24 and all(u["total"] == 24 for u in updates)
    within = [u for u in updates if u["shards_done"] == 0]
    assert len(within) >= 4 and within[0]["done"] <= 6  # per batch of <= 6, before the shard is written
    lines = [m for m in messages if "samples/s" in m]
    assert len(lines) >= 4 and all("ETA" in line and "new tokens/s" in line for line in lines)
    assert lines[0].startswith("generation: ") and lines[-1].startswith("generation: 24/24 samples (100%)")

    # A Dask worker cannot call back into this process: it leaves its counts in a file instead.
    plan = plan_generation(cfg, teacher_dir=tiny_model_dir, control_codes_path=codes_path, ledger=[],
                           out_dir=tmp_path / "again", seed=3)
    stats = generation_shard_task.fn(plan, 0)
    assert _read_shard_progress(plan, 0) == (24, stats["new_tokens"])

    # The synthetic data is public: distilling from it logs steps, tokens/s and the loss, and
    # the teacher cache logs its samples.
    with captured("pipeline") as messages:
        distill(DistillConfig(candidates=[], epochs=1, batch_size=8, teacher_top_k=5), synthetic_path=result.path,
                teacher_dir=tiny_model_dir, student_model=str(tiny_model_dir), out_dir=tmp_path / "student",
                seed=0, progress_every=0)
    cache = [m for m in messages if m.startswith("teacher cache: ") and "samples/s" in m]
    steps = [m for m in messages if m.startswith("distillation: ") and "steps/s" in m]
    assert cache and cache[-1].startswith(f"teacher cache: {result.n_samples}/{result.n_samples} samples")
    assert len(steps) >= 2 and all("tokens/s" in m and "loss=" in m and "ETA" in m for m in steps)


def test_evaluation_counts_windows_over_all_models(splits, tiny_model_dir, tmp_path):
    with captured("pipeline.stages.evaluate") as messages:
        evaluate_models(EvalConfig(window=32, batch_size=4), models={"a": str(tiny_model_dir),
                                                                     "b": str(tiny_model_dir)},
                        test_path=splits.test, out_dir=tmp_path, seed=0, progress_every=0)
    lines = [m for m in messages if "windows/s" in m]
    counts = [tuple(map(int, re.match(r"evaluation: (\d+)/(\d+) windows", m).groups())) for m in lines]
    total = counts[0][1]
    assert len(lines) >= 4 and [d for d, _ in counts] == sorted(d for d, _ in counts)
    assert counts[-1] == (total, total) and "model=a" in lines[0] and "model=b" in lines[-1]
    assert not re.search(r"token", " ".join(lines))


def test_a_models_perplexity_is_read_from_the_cache_until_its_weights_change(splits, tiny_model_dir, tmp_path):
    cfg, cache = EvalConfig(window=32, batch_size=4), tmp_path / "cache"

    def run(models):
        with captured("pipeline.stages.evaluate") as messages:
            result = evaluate_models(cfg, models=models, test_path=splits.test, out_dir=tmp_path, seed=0,
                                     progress_every=0, cache_dir=cache)
        return result["perplexity"], messages

    first, _ = run({"a": str(tiny_model_dir)})
    assert len(list(cache.glob("*.json"))) == 1 and oct(cache.stat().st_mode & 0o777) == "0o700"
    # Another name, same files: read back, and only the other model's windows are counted.
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    model = load_causal_lm(changed)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(2.0)
    model.save_pretrained(changed)
    again, messages = run({"base": str(tiny_model_dir), "changed": str(changed)})
    assert again["base"] == {**first["a"], "model": str(tiny_model_dir)}
    assert any(m.startswith("evaluation: base perplexity") and m.endswith("(cached)") for m in messages)
    assert not any(m.startswith("evaluation: changed perplexity") and m.endswith("(cached)") for m in messages)
    assert again["changed"]["windowed"] != first["a"]["windowed"]  # new weights: computed, not read back
    assert all("model=changed" in m for m in messages if "windows/s" in m)
