"""experiments/results_table.py: the README's table takes a method's cell (ours' or a baseline's) from
the public proxy's chosen learning rate where that study ran it, marked, and from the config's
settings elsewhere."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_table", ROOT / "experiments" / "results_table.py")
results_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_table)


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(row: str, student: float, repeat: int = 1) -> dict:
    # each run its own DP teacher, a hair apart (runs that share one get their cell marked ˢ)
    return {"config": "smollm2-yelp", "row": row, "repeat": repeat, "student": student,
            "student_text_windowed": student + 50, "dp_teacher": 57.0 + repeat / 1e4, "zero_shot": 598.0}


def _columns(name: str = "smollm2_yelp.jsonl") -> dict:
    return {col: (name, "smollm2-yelp", row) for col, row in (("ours", "ours"), ("dpsgd", "DP-SGD"), ("dpkd", "DPKD"))}


def _proxy(phase: str, method: str, multiple: float, student: float, repeat: int = 1) -> dict:
    return {"config": "smollm2-yelp", "phase": phase, "method": method, "multiple": multiple, "repeat": repeat,
            "student": student, "student_text_windowed": student + 80, "dp_teacher": 50.0 + repeat / 1e4}


def test_a_baselines_cell_is_the_proxys_choice_where_it_ran_and_the_configs_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(results_table, "RESULTS", tmp_path)
    monkeypatch.setattr(results_table, "SOURCES", (("Yelp", _columns(), "smollm2-yelp"),))
    _write(tmp_path / "smollm2_yelp.jsonl", [_row("ours", 200.0), _row("ours", 202.0, 2),
                                              _row("DP-SGD", 368.0), _row("DPKD", 366.0)])
    # DP-SGD's proxy grid picks 2 (interior); DPKD's best sits at the edge, so it has no choice yet
    _write(tmp_path / "public_proxy.jsonl", [
        _proxy("proxy", "dpsgd", 0.5, 580.0), _proxy("proxy", "dpsgd", 1.0, 465.0), _proxy("proxy", "dpsgd", 2.0, 427.0),
        _proxy("proxy", "dpsgd", 4.0, 428.0), _proxy("private", "dpsgd", 2.0, 304.0),
        _proxy("private", "dpsgd", 2.0, 308.0, 2), _proxy("private", "dpsgd", 2.0, 306.0, 3),
        _proxy("private", "dpsgd", 1.0, 365.0), _proxy("proxy", "dpkd", 0.5, 600.0), _proxy("proxy", "dpkd", 1.0, 500.0)])
    windowed, text = results_table.table().splitlines()[2:]
    assert windowed == "| Yelp | windowed | 201.0±1.4 | 306.0±2.0ᵖ | 366.0±– | – | 57.0±0.0 | – | 598.0±0.0 |"
    assert text.split(" | ")[2:5] == ["251.0±1.4", "386.0±2.0ᵖ", "416.0±–"]


def test_ours_cell_and_its_teachers_come_from_its_proxy_choice_once_all_its_private_runs_landed(tmp_path, monkeypatch):
    monkeypatch.setattr(results_table, "RESULTS", tmp_path)
    monkeypatch.setattr(results_table, "SOURCES", (("Yelp", _columns(), "smollm2-yelp"),))
    _write(tmp_path / "smollm2_yelp.jsonl", [_row("ours", 200.0), _row("DP-SGD", 368.0)])
    grid = [_proxy("proxy", "ours", m, s) for m, s in ((0.5, 81.0), (1.0, 79.0), (2.0, 80.0), (4.0, 84.0))]
    _write(tmp_path / "public_proxy.jsonl", grid)
    assert results_table.table().splitlines()[2].split(" | ")[2] == "200.0±–"  # chosen, no private run yet
    private = [_proxy("private", "ours", 1.0, 190.0), _proxy("private", "ours", 1.0, 194.0, 2)]
    _write(tmp_path / "public_proxy.jsonl", grid + private)
    assert results_table.table().splitlines()[2].split(" | ")[2] == "200.0±–"  # two of three: not yet
    _write(tmp_path / "public_proxy.jsonl", grid + private + [_proxy("private", "ours", 1.0, 192.0, 3)])
    windowed = results_table.table().splitlines()[2]
    # the DP teacher from the proxy's runs; the base student, which they do not record, from ours' own
    assert windowed == "| Yelp | windowed | 192.0±2.0ᵖ | 368.0±– | – | – | 50.0±0.0 | – | 598.0±– |"


def test_a_corpus_takes_each_column_from_the_study_that_ran_it(tmp_path, monkeypatch):
    """Ours and the ε = 0 control from one study's file, DPKD from another's: each cell from its own
    file and row, the teachers' cells from ours' runs, a sweep's run (target_epsilon) left out."""
    monkeypatch.setattr(results_table, "RESULTS", tmp_path)
    columns = _columns("smollm2_yelp.jsonl") | {"ours": ("utility.jsonl", "smollm2-yelp", "ours"),
                                                "public_only": ("utility.jsonl", "smollm2-yelp", "public-only")}
    monkeypatch.setattr(results_table, "SOURCES", (("Yelp", columns, "smollm2-yelp"),))
    _write(tmp_path / "smollm2_yelp.jsonl", [_row("ours", 200.0), _row("DPKD", 366.0)])
    _write(tmp_path / "utility.jsonl", [{**_row("ours", 210.0), "dp_teacher": 43.0}, _row("public-only", 244.0),
                                        {**_row("ours", 150.0, 2), "target_epsilon": 8.0}])
    _write(tmp_path / "public_proxy.jsonl", [])
    windowed = results_table.table().splitlines()[2]
    assert windowed == "| Yelp | windowed | 210.0±– | – | 366.0±– | 244.0±– | 43.0±– | – | 598.0±– |"


def test_a_cell_whose_runs_share_a_dp_teacher_is_marked(tmp_path, monkeypatch):
    """DPKD's repeats before 2026-11-30 reran its student alone: three runs, one DP teacher. Their
    cell is marked ˢ (not independent draws of all their noise); runs with their own are not."""
    monkeypatch.setattr(results_table, "RESULTS", tmp_path)
    monkeypatch.setattr(results_table, "SOURCES", (("Yelp", _columns(), "smollm2-yelp"),))
    shared = [{**_row("DPKD", 366.0 + k, k), "dp_teacher": 57.8} for k in (1, 2, 3)]
    _write(tmp_path / "smollm2_yelp.jsonl", [_row("ours", 200.0), _row("ours", 202.0, 2), *shared])
    windowed = results_table.table().splitlines()[2]
    assert windowed.split(" | ")[2:5] == ["201.0±1.4", "–", "368.0±1.0ˢ"]


def test_a_row_takes_no_proxy_cell_whose_study_trained_another_student(tmp_path, monkeypatch):
    """The SmolLM2 tweets config ships the 8-layer student, which the public-proxy study trains;
    the utility study's tweets rows pin the 4-layer one: the row keeps its own cells."""
    assert results_table.proxy_student("smollm2-airline") == "cache:smollm2-135m-8l"
    assert results_table.proxy_student("smollm2-yelp") == results_table.STUDENTS["smollm2-yelp"]
    monkeypatch.setattr(results_table, "RESULTS", tmp_path)
    monkeypatch.setattr(results_table, "SOURCES", (("Yelp", _columns(), "smollm2-yelp"),))
    monkeypatch.setattr(results_table, "STUDENTS", {"smollm2-yelp": "cache:smollm2-135m-8l"})
    _write(tmp_path / "smollm2_yelp.jsonl", [_row("ours", 200.0), _row("DP-SGD", 368.0)])
    _write(tmp_path / "public_proxy.jsonl", [
        _proxy("proxy", "dpsgd", 0.5, 580.0), _proxy("proxy", "dpsgd", 1.0, 465.0), _proxy("proxy", "dpsgd", 2.0, 427.0),
        _proxy("proxy", "dpsgd", 4.0, 428.0)] + [_proxy("private", "dpsgd", 2.0, 304.0 + k, k) for k in (1, 2, 3)])
    assert results_table.proxy_runs("smollm2-yelp") == {}
    assert results_table.table().splitlines()[2].split(" | ")[2:4] == ["200.0±–", "368.0±–"]


def test_the_smollm2_yelp_row_holds_ours_and_the_control_as_the_config_ships_them():
    """The README's SmolLM2 Yelp cells of ours and the ε = 0 control come from utility rows that
    resolve to configs/smollm2_yelp.yaml as shipped (its stars named since dfd5c5e), the control
    with distill.method=public_only: the study's `ours` row, pinned to the raw star values, is a
    config no user gets."""
    from experiments.shared import PINNED, config_digest, config_path
    from experiments.utility import overrides
    from pipeline.config import load_config

    columns = next(cols for _, cols, config in results_table.SOURCES if config == "smollm2-yelp")
    path, pins = config_path("smollm2-yelp"), list(PINNED["smollm2-yelp"])
    for col, method in (("ours", "distil"), ("public_only", "public_only")):
        name, config, row = columns[col]
        assert (name, config) == ("utility.jsonl", "smollm2-yelp")
        shipped = load_config(path, [*pins, f"distill.method={method}"])
        assert config_digest(load_config(path, overrides(row, config, 1))) == config_digest(shipped), (col, row)


def test_the_control_joins_ours_at_the_proxys_rate_once_all_its_runs_landed(tmp_path, monkeypatch):
    """Ours at the proxy's choice (2 × the pinned 3e-4) is compared with the ε = 0 control at the
    same rate (`public-only-words-2x`), marked, once its three runs landed; until then, or where
    ours ran at another rate than the row's, the control's cell stays the config's."""
    monkeypatch.setattr(results_table, "RESULTS", tmp_path)
    columns = _columns() | {"public_only": ("utility.jsonl", "smollm2-yelp", "public-only-words"),
                            "public_only_proxy": ("utility.jsonl", "smollm2-yelp", "public-only-words-2x")}
    monkeypatch.setattr(results_table, "SOURCES", (("Yelp", columns, "smollm2-yelp"),))
    _write(tmp_path / "smollm2_yelp.jsonl", [_row("ours", 215.0)])
    grid = [_proxy("proxy", "ours", m, s) for m, s in ((0.5, 182.0), (1.0, 163.0), (2.0, 160.0), (4.0, 164.0))]

    def ours_at(rate: float) -> list[dict]:
        return [{**_proxy("private", "ours", 2.0, 202.0 + k, k), "learning_rate": rate} for k in (1, 2, 3)]

    control = [_row("public-only-words", 221.0)] + [_row("public-only-words-2x", 208.0 + k, k) for k in (1, 2)]
    _write(tmp_path / "utility.jsonl", control)
    _write(tmp_path / "public_proxy.jsonl", grid + ours_at(6e-4))
    assert results_table.table().splitlines()[2].split(" | ")[2:6] == ["204.0±1.0ᵖ", "–", "–", "221.0±–"]
    _write(tmp_path / "utility.jsonl", control + [_row("public-only-words-2x", 211.0, 3)])
    assert results_table.table().splitlines()[2].split(" | ")[5] == "210.0±1.0ᵖ"
    _write(tmp_path / "public_proxy.jsonl", grid + ours_at(1.2e-3))  # another rate than the row's
    assert results_table.table().splitlines()[2].split(" | ")[5] == "221.0±–"
