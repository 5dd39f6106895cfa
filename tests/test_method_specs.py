"""pipeline/methods.py: one spec per method, and the only module that compares a method's name."""

import ast
from pathlib import Path

import pytest

from pipeline.methods import METHOD_NAMES, METHODS, method_spec

ROOT = Path(__file__).resolve().parents[1]


def _name_literals(path: Path, compared_only: bool = False) -> list[tuple[int, str]]:
    """(line, literal) of every string literal in `path` that is exactly a method's name; with
    `compared_only`, of those compared (`==`, `!=`, `in`, `is`, alone or in a tuple, list or set)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if compared_only:
        compared = [n for c in ast.walk(tree) if isinstance(c, ast.Compare) for n in (c.left, *c.comparators)]
        nodes = [m for n in compared for m in ast.walk(n)]
    return sorted((node.lineno, node.value) for node in nodes
                  if isinstance(node, ast.Constant) and node.value in METHOD_NAMES)


def test_no_module_but_methods_names_a_method():
    """A method's name appears as a literal only in pipeline/methods.py: everything else reads the
    spec (CONVENTIONS 17). A new method then touches its spec and its tests, not six files."""
    found = {}
    for folder in ("pipeline", "flows", "experiments", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "pipeline" / "methods.py":
                continue
            # The studies' row labels ("dpkd") share a name with a method in their tracked results
            # files: there, only a comparison is a method's name.
            if hits := _name_literals(path, compared_only=folder == "experiments"):
                found[str(path.relative_to(ROOT))] = hits
    assert not found, f"method names outside pipeline/methods.py: {found}"


def test_the_literal_scan_finds_a_comparison(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('if cfg.distill.method in ("distil", \'dp_syn\'):\n    pass\nx = "distill.method=dp_sgd"\n'
                    'rows = {"dpkd": 1}\nok = m.name != "dpkd"\n')
    assert _name_literals(path) == [(1, "distil"), (1, "dp_syn"), (4, "dpkd"), (5, "dpkd")]
    assert _name_literals(path, compared_only=True) == [(1, "distil"), (1, "dp_syn"), (5, "dpkd")]


@pytest.mark.parametrize("name, stages", [
    ("distil", ("control-codes", "teacher", "generation", "distillation", "evaluation")),
    ("dp_syn", ("control-codes", "teacher", "generation", "distillation", "evaluation")),
    ("dp_sgd", ("dp-student", "evaluation")),
    ("dpkd", ("teacher", "dp-student", "evaluation")),
    ("public_only", ("control-codes", "generation", "distillation", "evaluation")),
])
def test_each_method_runs_its_stages(name, stages):
    assert method_spec(name).stages == stages


@pytest.mark.parametrize("name", [m.name for m in METHODS.values() if m.budget_shares])
def test_the_shares_spend_the_whole_budget_exactly(name):
    for eps in (0.3, 1.0, 2.0, 7.77):
        budget = method_spec(name).budget(eps)
        assert sum(budget.values()) == eps
        assert list(budget) == [s for s in method_spec(name).stages if s in ("teacher", "dp-student")]


def test_dpkd_halves_the_budget_and_the_others_spend_it_once():
    assert method_spec("dpkd").budget(2.0) == {"teacher": 1.0, "dp-student": 1.0}
    assert method_spec("distil").budget(2.0) == {"teacher": 2.0}
    assert method_spec("dp_sgd").budget(2.0) == {"dp-student": 2.0}


def test_the_flow_has_a_step_for_every_stage_of_every_method():
    from flows.pipeline_flow import STEPS
    from pipeline.privacy.control_codes import STAGE

    assert "control-codes" == STAGE
    assert {s for m in METHODS.values() for s in m.stages} <= set(STEPS)


def test_only_the_control_reads_no_private_record():
    assert [m.name for m in METHODS.values() if not m.reads_private] == ["public_only"]
    assert method_spec("public_only").budget(2.0) == {}


def test_the_control_needs_the_public_domain_and_no_private_choice():
    from conftest import tiny_pipeline_dict
    from pipeline.config import ConfigError, config_from_dict

    tree = tiny_pipeline_dict(Path("/tmp"))
    tree["distill"]["method"] = "public_only"
    tree["control_codes"] = {"mechanism": "exact"}  # no domain: nothing public to prompt from
    with pytest.raises((ConfigError, ValueError), match="public_only prompts the base teacher uniformly"):
        config_from_dict(tree)
    tree = tiny_pipeline_dict(Path("/tmp"))
    tree["distill"] |= {"method": "public_only", "select_by": "private_validation",
                        "candidates": [{"alpha": 0.4}, {"alpha": 1.0}]}
    with pytest.raises((ConfigError, ValueError), match="reads no private record"):
        config_from_dict(tree)


def test_exactly_one_method_is_ours():
    assert [m.name for m in METHODS.values() if m.ours] == ["distil"]


def test_the_control_plans_no_release(tmp_path):
    """The ε = 0 control's plan: no DP entry, a total of 0, and no DP-SGD stage handed a σ."""
    from conftest import tiny_pipeline_dict
    from pipeline.config import config_from_dict
    from pipeline.plan import make_plan

    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["method"] = "public_only"
    plan = make_plan(config_from_dict(tree))
    assert plan.entries == [] and plan.dp_sgd == {} and plan.total.epsilon == 0 and plan.total.complete


def test_a_repeat_reruns_from_the_first_stage_that_draws_dp_noise():
    """An independent repeat draws every DP release afresh: ours and DP-Syn from their code
    release, DPKD from its DP teacher (its student's noise is not all of it), DP-SGD from its
    student; the ε = 0 control draws none."""
    stages = {name: method_spec(name).noisy_stage for name in METHOD_NAMES}
    assert stages == {"distil": "control-codes", "dp_syn": "control-codes", "dp_sgd": "dp-student",
                      "dpkd": "teacher", "public_only": None}
    for name, stage in stages.items():
        spec = method_spec(name)
        noisy = [s for s in spec.stages if s in spec.budget_shares or (s == "control-codes" and spec.releases_codes)]
        assert stage == (noisy[0] if noisy else None), name
