"""Devices and precision (issue 11): resolution and refusals, bk clipping under bf16 autocast,
the tiny pipeline in bf16 against fp32, and every stage on the configured device and dtype."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import ROOT, make_tiny_model, tiny_pipeline_dict
from pipeline.batching import TokenizedRecords, lm_batch
from pipeline.privacy.bk import BookKeepingPrivacyEngine
from pipeline.config import ConfigError, DistillConfig, EvalConfig, GenerateConfig, TeacherConfig, config_from_dict
from pipeline.devices import DeviceError, Runtime, default_threads, resolve_device
import pipeline.stages.distill
import pipeline.stages.evaluate
import pipeline.stages.generate
import pipeline.stages.logit_cache
import pipeline.stages.sampling
import pipeline.privacy.bk_rules
import pipeline.stages.teacher.monitor
import pipeline.stages.teacher.recipe
from pipeline.models.base import untie_lm_head
from pipeline.privacy.noise import TEST_SEED_ENV
from pipeline.preflight import check_inputs
from pipeline.models.losses import per_sequence_loss

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a CPU-only machine")


# --- resolution and refusals ---------------------------------------------------------------

@needs_no_cuda
def test_auto_is_the_cpu_here_and_cuda_is_refused_at_preflight(tmp_path):
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"device=cuda:1 but this machine has no usable CUDA device"):
        resolve_device("cuda:1")
    cfg = config_from_dict({**tiny_pipeline_dict(tmp_path), "device": "cuda", "precision": "bf16"})
    problems = [p for p in check_inputs(cfg) if "device" in p]
    assert len(problems) == 1 and "set device=auto or device=cpu" in problems[0]
    assert not [p for p in check_inputs(config_from_dict(tiny_pipeline_dict(tmp_path))) if "device" in p]


@pytest.mark.parametrize("update, message", [
    ({"device": "gpu"}, "device = 'gpu'"),
    ({"precision": "fp16"}, "precision=fp16 is not supported"),
    ({"precision": "half"}, "precision = 'half'"),
    ({"threads": 0}, "threads = 0"),
    ({"device": "cuda", "teacher": {"processes": 2, "ddp_backend": "gloo"}}, "gloo ranks run on the CPU"),
    ({"device": "cpu", "teacher": {"processes": 2, "ddp_backend": "nccl"}}, "gloo ranks run on the CPU"),
])
def test_bad_device_settings_are_one_config_error_naming_the_field(tmp_path, update, message):
    tree = tiny_pipeline_dict(tmp_path)
    for key, value in update.items():
        tree[key] = {**tree[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tree)


def test_threads_default_to_omp_num_threads_else_a_share_of_the_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3 and Runtime(threads=2).threads_for(4) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_threads() == 4 and default_threads(processes=8) == 2 and default_threads(processes=32) == 1
    before = torch.get_num_threads()
    try:
        assert Runtime(threads=1).apply_threads() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


_MMAPPED_BY_A_64MB_TENSOR = """
import ctypes, sys
import torch
from pipeline.devices import Runtime

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "stage":
    Runtime(threads=1).apply_threads()  # what every stage does first
before = libc.mallinfo2().hblkhd
x = torch.empty(2**24)  # 64 MB of fp32, as a distillation step's logits
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="glibc >= 2.33 only")
def test_stages_have_malloc_reuse_freed_memory_instead_of_mapping_large_tensors_afresh():
    """glibc maps every block over 32 MB afresh and unmaps it when freed, so each large tensor
    page-faults in new memory (a distillation step's loss ran 2.3x slower for it). After a
    stage's `apply_threads` a 64 MB tensor comes from malloc's heap (no mmap'd bytes added); in
    a process that skipped it, the same tensor is mmap'd (the control: the measure sees it)."""
    import subprocess
    import sys

    def mmapped(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _MMAPPED_BY_A_64MB_TENSOR, mode], cwd=ROOT, capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        return int(out.stdout.split()[-1])

    assert mmapped("plain") >= 2**26
    assert mmapped("stage") == 0


def test_runtime_round_trips_to_data_parallel_ranks():
    rt = Runtime(torch.device("cpu"), "bf16", 2)
    assert Runtime.from_json(json.loads(json.dumps(rt.to_json()))) == rt
    nccl = rt.for_ddp("nccl").for_rank(3)
    assert nccl.device == torch.device("cuda", 3) and nccl.precision == "bf16"
    assert rt.for_ddp("gloo").for_rank(3).device == torch.device("cpu")


# --- bk clipping under autocast -------------------------------------------------------------

def test_bk_clipping_under_bf16_autocast_matches_fp32(tiny_tokenizer):
    """The bk Functions run their products in autocast's bf16 (forward and backward) with fp32
    master weights; the clipped gradient lands in fp32 .grad within bf16 rounding of fp32's."""
    torch.manual_seed(0)
    base = make_tiny_model(tiny_tokenizer)
    untie_lm_head(base)
    texts = [[5, 9, 23, 7, 81, 2], [40, 3, 3, 3, 17], [11, 12, 13, 14, 15, 16, 17, 18]]
    data = TokenizedRecords(texts, tiny_tokenizer.pad_token_id, 16)
    grads = {}
    for precision in ("fp32", "bf16"):
        model = make_tiny_model(tiny_tokenizer)
        untie_lm_head(model)
        model.load_state_dict(base.state_dict())
        loader = torch.utils.data.DataLoader(data, batch_size=3)
        dp_model, optimizer, _ = BookKeepingPrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=0.05, poisson_sampling=False, grad_sample_mode="bk")
        batch = lm_batch(data.ids, data.lengths)
        labels = batch.pop("labels")
        with Runtime(precision=precision).autocast():
            logits = dp_model(**batch).logits
        assert logits.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        coef = dp_model.backward_clipped(per_sequence_loss(logits, labels))
        assert (coef < 1).all()  # every example clipped: the norms were computed, in fp32
        grads[precision] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    rel = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert 0 < rel < 0.05, rel


# --- the tiny pipeline, stage by stage ------------------------------------------------------

def _pipeline(splits, model_dir: Path, out: Path, runtime: Runtime) -> dict:
    """Teacher (DP-SGD, bk) → generation → top-k logit cache + distillation → evaluation,
    each called through its module so that the observing test can wrap it."""
    teacher = pipeline.stages.teacher.recipe.train_teacher(
        TeacherConfig(target_epsilon=3.0, epochs=1, batch_size=25, physical_batch_size=10, max_length=48,
                      learning_rate=1e-3, monitor="dp"),  # monitored: its forwards are observed too
        train_path=splits.train, validation_path=splits.validation, base_model=str(model_dir),
        out_dir=out / "teacher", seed=0, runtime=runtime)
    codes = out / "codes.json"
    codes.write_text(json.dumps({"counts": {"Category: A": 3, "Category: B": 1}}))
    synthetic = pipeline.stages.generate.generate_synthetic(
        GenerateConfig(num_samples=24, batch_size=12, max_length=32, validation_fraction=0.2),
        teacher_dir=teacher.checkpoint, control_codes_path=codes, ledger=[], out_dir=out / "synthetic", seed=0,
        runtime=runtime)
    student = pipeline.stages.distill.distill(
        DistillConfig(candidates=[], epochs=1, batch_size=8, learning_rate=1e-3, teacher_top_k=20, eval_every=2),
        synthetic_path=synthetic.path, teacher_dir=teacher.checkpoint, student_model=str(model_dir),
        out_dir=out / "student", seed=0, runtime=runtime)
    return pipeline.stages.evaluate.evaluate_models(
        EvalConfig(window=32, batch_size=8), models={"dp_teacher": str(teacher.checkpoint),
                                                     "student": str(student.checkpoint)},
        test_path=splits.test, out_dir=out / "evaluation", seed=0, runtime=runtime, synthetic_path=synthetic.path,
        code_values={"label1": {v: v for v in ("Category: A", "Category: B")}})


# Stage functions observed, and the label their model calls get (the innermost wins).
OBSERVED = [
    (pipeline.stages.teacher.recipe, "_step", "teacher training"),
    (pipeline.stages.teacher.monitor, "per_record_losses", "teacher validation"),
    # one shard's samples, as the stage draws them and as the selection's untruncated samples are drawn
    (pipeline.stages.generate, "sample_shard", "generation"), (pipeline.stages.sampling, "sample_shard", "generation"),
    (pipeline.stages.logit_cache, "_write_shard", "logit cache"),
    (pipeline.stages.distill, "distill", "distillation"), (pipeline.stages.evaluate, "perplexity", "evaluation"),
    (pipeline.stages.evaluate, "_adherence", "code adherence"),
    # bk's rule for a norm layer: its own forward probed once at wrap time, on a float32 CPU copy
    (pipeline.privacy.bk_rules, "_elementwise_kind", "bk probe"),
]
TRAINING = {"teacher training", "teacher validation", "distillation"}  # fp32 master weights, autocast


class _Forwards:
    """Every call of a module holding parameters, seen by a global forward pre-hook and
    labelled with the innermost observed stage function running: its parameters' devices and
    dtypes, its tensor inputs' devices, whether autocast was on."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        self.stages: list[str] = []
        for module, name, label in OBSERVED:
            monkeypatch.setattr(module, name, self._labelled(getattr(module, name), label))

    def _labelled(self, fn, label):
        def run(*args, **kwargs):
            self.stages.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stages.pop()
        return run

    def __call__(self, module, args):
        params = list(module.parameters(recurse=False))
        if params:
            self.calls.append({
                "stage": self.stages[-1] if self.stages else None, "module": type(module).__name__,
                "param_devices": {p.device for p in params}, "param_dtypes": {p.dtype for p in params},
                "input_devices": {a.device for a in args if isinstance(a, torch.Tensor)},
                "autocast": torch.is_autocast_enabled(params[0].device.type),
            })


def test_tiny_pipeline_in_bf16_on_the_configured_device(splits, tiny_model_dir, tmp_path, monkeypatch):
    """The stages run in bf16 on CPU, every model call on the configured device and in the
    configured precision, and the perplexities come within 1% of fp32's (the tiny models are
    near uniform: a loose check of bf16, a strict one of the plumbing).

    What the observation proves, on a CPU-only machine: every call of every parameterised
    module in every stage (Opacus' wrapped teacher included) had its parameters and its inputs
    on `runtime.device`, and ran in the runtime's precision: the training stages under
    autocast with fp32 master weights, the inference stages (generation, logit cache,
    evaluation and its code adherence) with bf16 weights. CPU being the only device here, the device half alone
    cannot catch a stage that pins the CPU; the precision half catches a stage that ignores
    the runtime (a load without its dtype, a forward outside its autocast, as after the
    `model.cpu()` the teacher's save path had), and `test_no_stage_names_the_cpu` catches a
    pinned CPU. The DP noise is fixed by the test hook: both runs train with the same noise.
    """
    monkeypatch.setenv(TEST_SEED_ENV, "1234")
    fp32 = _pipeline(splits, tiny_model_dir, tmp_path / "fp32", Runtime(precision="fp32"))
    rt = Runtime(device=resolve_device("auto"), precision="bf16")
    forwards = _Forwards(monkeypatch)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(forwards)
    try:
        bf16 = _pipeline(splits, tiny_model_dir, tmp_path / "bf16", rt)
    finally:
        handle.remove()

    by_stage: dict[str, list[dict]] = {}
    for call in forwards.calls:
        by_stage.setdefault(call["stage"], []).append(call)
    outside = {c["module"] for c in by_stage.get(None, [])}
    assert set(by_stage) == {label for _, _, label in OBSERVED}, outside  # no model call outside them
    probes = by_stage.pop("bk probe")
    assert all(c["param_devices"] == {torch.device("cpu")} and c["param_dtypes"] == {torch.float32} for c in probes)
    for stage, calls in by_stage.items():
        assert all(c["param_devices"] == {rt.device} and c["input_devices"] <= {rt.device} for c in calls), stage
        if stage in TRAINING:
            assert all(c["autocast"] and c["param_dtypes"] == {torch.float32} for c in calls), stage
        else:
            assert all(c["param_dtypes"] == {torch.bfloat16} for c in calls), stage

    for name in ("dp_teacher", "student"):
        a, b = fp32["perplexity"][name]["windowed"], bf16["perplexity"][name]["windowed"]
        assert abs(b - a) / a < 0.01, (name, a, b)  # measured: 0.0000 and 0.0006


STAGE_MODULES = ["pipeline/stages/teacher/recipe.py", "pipeline/stages/teacher/monitor.py",
                 "pipeline/stages/teacher/checkpoint.py", "pipeline/stages/generate.py", "pipeline/stages/logit_cache.py", "pipeline/stages/distill.py",
                 "pipeline/stages/evaluate.py", "pipeline/stages/adherence.py", "flows/generation.py"]


@pytest.mark.parametrize("path", STAGE_MODULES)
def test_no_stage_names_the_cpu(path):
    """A stage places models and batches with its runtime's device only: no `.cpu()` call, no
    "cpu" string (as in `torch.device("cpu")`, `.to("cpu")`), except `map_location="cpu"`,
    which reads a checkpoint's RNG states (CPU tensors by torch's contract) and copies weights
    into the parameters wherever they are. Host copies for NumPy use `.numpy(force=True)`."""
    tree = ast.parse((ROOT / path).read_text())
    allowed = {id(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
               for k in node.keywords if k.arg == "map_location"}
    found = [node.lineno for node in ast.walk(tree)
             if (isinstance(node, ast.Constant) and node.value == "cpu" and id(node) not in allowed)
             or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cpu")]
    assert not found, f"{path} names the CPU on lines {found}; use the runtime's device"


def test_every_training_stage_steps_with_the_fused_adamw_the_same_update():
    """pipeline/devices.py adamw: fused on a CPU (one pass per parameter, bench/adamw.py), the loop's
    update to float rounding over steps with weight decay; unfused where a parameter is not a
    floating-point CPU/CUDA tensor. No training stage builds torch's AdamW itself."""
    from pipeline.devices import adamw

    torch.manual_seed(0)
    start = [torch.randn(40, 30), torch.randn(30)]
    a, b = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    fused, loop = adamw(a, 1e-2, 0.1), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] and not adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], 1e-2) \
        .defaults["fused"]
    assert not adamw(a, 1e-2, fused=False).defaults["fused"]  # the public model builder: bit-identical rebuilds
    for _ in range(5):
        grads = [torch.randn_like(t) for t in start]
        for ps, opt in ((a, fused), (b, loop)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for x, y, s in zip(a, b, start):
        assert not torch.equal(x, s)
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    built = [str(p.relative_to(ROOT)) for p in (ROOT / "pipeline").rglob("*.py")
             if "torch.optim.AdamW(" in p.read_text() and p.name != "devices.py"]
    assert built == [], f"{built} build AdamW themselves: use pipeline.devices.adamw"
