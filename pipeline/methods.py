"""One spec per method (`distill.method`): its stages, its DP releases and their shares of the
budget, what the student trains on. The only module that compares a method's name; the plan,
the flow, the reports and the experiments read the spec.

    spec = method_spec(cfg.distill.method)
    spec.stages              # ('control-codes', 'teacher', 'generation', 'distillation', 'evaluation')
    spec.budget_shares       # {'teacher': 1.0}: each DP-SGD stage's share of teacher.target_epsilon
                             # (pipeline/plan.py dp_sgd_budgets scales several up to compose to it)

Adding a method is one `Method` here and its tests (CONVENTIONS 17). A method's stages follow from
its fields, so the flow's order (codes, teacher, generation, student, evaluation) is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CODES_STAGE = "control-codes"  # pipeline/privacy/control_codes.py STAGE (no import: methods import nothing)


@dataclass(frozen=True)
class Method:
    name: str
    """The value of `distill.method`."""
    words: str
    """How reports and verdicts name it."""
    budget_shares: dict[str, float] = field(default_factory=dict)
    """Each DP-SGD stage ('teacher', 'dp-student') and its share of `teacher.target_epsilon`, in run order."""
    releases_codes: bool = False
    """Whether generation is prompted by a DP release of the private training split's codes; a
    generating method without it draws its prompts uniformly from the public `control_codes.domain`."""
    student_on: str = "synthetic"
    """'synthetic': the student learns from text the teacher writes (not private: post-processing);
    'private': the student itself trains with DP-SGD on the private records."""
    teacher_logits: bool = True
    """Whether the student learns the teacher's distribution (the KL term), not only its text."""
    default_alpha: float = 1.0
    """α when `distill.alpha` is unset."""
    ours: bool = False
    """The method the report's verdict measures the others against."""

    def __post_init__(self):
        assert self.student_on in ("synthetic", "private"), self.student_on
        assert set(self.budget_shares) <= {"teacher", "dp-student"}, self.budget_shares
        assert abs(sum(self.budget_shares.values()) - 1) < 1e-12 or not self.budget_shares, self.budget_shares

    @property
    def generates(self) -> bool:
        """Whether a teacher writes synthetic text (the generation stage runs)."""
        return self.student_on == "synthetic"

    @property
    def dp_teacher(self) -> bool:
        """Whether a teacher is DP-SGD fine-tuned on the private records."""
        return "teacher" in self.budget_shares

    @property
    def reads_private(self) -> bool:
        """Whether any stage but the data split and evaluation reads a private record: False is the
        ε = 0 control (the base teacher's text, public prompts)."""
        return bool(self.budget_shares) or self.releases_codes

    @property
    def dp_student(self) -> bool:
        """Whether the student itself trains with DP-SGD on the private records (a direct baseline)."""
        return self.student_on == "private"

    @property
    def student_stage(self) -> str:
        return "dp-student" if self.dp_student else "distillation"

    @property
    def distils(self) -> bool:
        """Whether the distillation reads teacher logits on synthetic text: the distill section's
        candidates, selection and KL settings apply (not to a DP-SGD student, nor to CE alone)."""
        return self.generates and self.teacher_logits

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages after the data and base models, in run order."""
        return ((CODES_STAGE,) if self.generates else ()) + (("teacher",) if self.dp_teacher else ()) \
            + (("generation",) if self.generates else ()) + (self.student_stage, "evaluation")

    @property
    def noisy_stage(self) -> str | None:
        """The first stage that draws DP noise (the code release, else the first DP-SGD stage): a
        repeat reruns it and every stage after it for an independent draw of all the run's noise
        (DPKD: its teacher, not only its student). None: no DP noise (the ε = 0 control)."""
        return CODES_STAGE if self.releases_codes else next(iter(self.budget_shares), None)

    def budget(self, epsilon: float) -> dict[str, float]:
        """ε of each DP-SGD stage at the run's `epsilon`: its share; the last takes what is left, so
        that the shares add up to `epsilon` exactly in floating point."""
        out, left = {}, epsilon
        for i, (stage, share) in enumerate(self.budget_shares.items()):
            out[stage] = left if i == len(self.budget_shares) - 1 else epsilon * share
            left -= out[stage]
        return out


DISTIL = Method("distil", "ours (distillation)", {"teacher": 1.0}, releases_codes=True, ours=True)
DP_SYN = Method("dp_syn", "DP-Syn (synthetic text alone)", {"teacher": 1.0}, releases_codes=True,
                teacher_logits=False)
DP_SGD = Method("dp_sgd", "DP-SGD of the student", {"dp-student": 1.0}, student_on="private", teacher_logits=False)
DPKD = Method("dpkd", "DPKD", {"teacher": 0.5, "dp-student": 0.5}, student_on="private", default_alpha=0.4)
# default_alpha 0.4: the best of {0.4, 1} for DPKD in every equal-effort study (docs/baselines.md).
PUBLIC_ONLY = Method("public_only", "ε = 0 control (the base teacher, no private record)")
# What the private records add (issue 59 item 2): ours' student and recipe, distilled from what
# the base teacher writes when prompted uniformly over the declared code domain; only the test
# split is read, by evaluation.

METHODS = {m.name: m for m in (DISTIL, DP_SYN, DP_SGD, DPKD, PUBLIC_ONLY)}
METHOD_NAMES = tuple(METHODS)


def method_spec(name: str) -> Method:
    """The spec of `distill.method` `name` (the config refuses any other name)."""
    return METHODS[name]


def words(name: str) -> str:
    """How reports name the method `name`; the name itself for one this version does not know."""
    return METHODS[name].words if name in METHODS else name
