"""What `pip install` needs to know: every module the code imports is declared in pyproject.toml,
and constraints.txt (the exact versions tested, which `make install`, CI and the images use)
lies inside pyproject's ranges, with the one torch pin everywhere torch is installed first.

Fast: reads files and this environment's package metadata, installs nothing."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared(*extras: str) -> dict[str, Requirement]:
    project = _pyproject()
    lines = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def _constraints() -> dict[str, Version]:
    pins = {}
    for n, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt line {n}: {line!r} is not name==version"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _third_party_imports(*folders: str) -> dict[str, set[str]]:
    """Top-level modules imported by the .py files under `folders` (absolute imports, at any
    depth: a lazy import inside a function counts), minus the standard library and the
    project's own modules; each with the files that import it."""
    own = {"pipeline", "flows", "bench", "experiments", "tests"} | {p.stem for f in folders for p in (ROOT / f).rglob("*.py")}
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {name.split(".")[0] for name in names} - own - set(sys.stdlib_module_names):
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _undeclared(imports: dict[str, set[str]], declared: dict[str, Requirement]) -> list[str]:
    dists = packages_distributions()  # import name -> the distributions that provide it
    problems = []
    for module, files in sorted(imports.items()):
        provided_by = {canonicalize_name(d) for d in dists.get(module, [])}
        if not provided_by:
            problems.append(f"{module} (imported by {', '.join(sorted(files))}) is not installed here")
        elif not provided_by & declared.keys():
            problems.append(f"{module} (imported by {', '.join(sorted(files))}) comes from "
                            f"{' or '.join(sorted(provided_by))}: add it to pyproject.toml")
    return problems


def test_every_module_the_package_imports_is_a_declared_dependency():
    # bench/ and experiments/ run from an installed checkout too, so they need no extra either;
    # the `models` extra is the one optional import: `dpdistill models fetch` says how to install it
    imports = _third_party_imports("pipeline", "flows", "bench", "experiments")
    imports.pop("triton")  # torch's CUDA wheels bring it; the next test holds where the package imports it
    problems = _undeclared(imports, _declared("models"))
    assert not problems, "\n".join(problems)


def test_only_bk_kernel_imports_triton_and_only_where_it_can_be_missing():
    """Triton comes with torch's CUDA builds, not with the CPU wheel this project installs: the one
    module of the package that imports it does so under `except ImportError` (bk then keeps its
    split); a bench about the kernel may need it outright."""
    assert _third_party_imports("pipeline", "flows", "experiments").get("triton") == {"pipeline/privacy/bk_kernel.py"}
    tree = ast.parse((ROOT / "pipeline/privacy/bk_kernel.py").read_text())
    guarded = [node for node in ast.walk(tree) if isinstance(node, ast.Try)
               and any(isinstance(n, ast.Import) and n.names[0].name == "triton" for n in node.body)
               and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers)]
    assert len(guarded) == 1


def test_only_the_model_fetch_imports_the_models_extra():
    """gguf is optional: a module that imported it on every run would break installs without the extra."""
    imports = _third_party_imports("pipeline", "flows", "bench", "experiments")
    assert imports.get("gguf") == {"pipeline/models/fetch.py"}


def test_every_module_the_tests_import_is_declared_with_the_dev_extra():
    problems = _undeclared(_third_party_imports("tests"), _declared("dev"))
    assert not problems, "\n".join(problems)


def test_the_scan_sees_a_lazy_import_and_an_undeclared_module():
    """The check can fail: pipeline/preflight.py imports huggingface_hub inside a function, and
    with huggingface_hub left out of pyproject the scan names it."""
    declared = {k: v for k, v in _declared().items() if k != "huggingface-hub"}
    imports = _third_party_imports("pipeline")
    assert "pipeline/preflight.py" in imports["huggingface_hub"] and "json" not in imports
    assert any(p.startswith("huggingface_hub") and "pyproject" in p for p in _undeclared(imports, declared))


def test_every_pin_satisfies_the_ranges_and_every_dependency_is_pinned():
    pins, declared = _constraints(), _declared("dev")
    outside = [f"{name}=={pins[name]} is outside pyproject's {req}" for name, req in sorted(declared.items())
               if name in pins and not req.specifier.contains(pins[name], prereleases=True)]
    unpinned = sorted(set(declared) - set(pins))
    assert not outside, "\n".join(outside)
    assert not unpinned, f"constraints.txt pins no version of {unpinned}: add the version tested"
    assert "dpdistill" not in pins, "constraints.txt must not pin the project itself"


def test_every_distribution_installed_here_is_pinned():
    # A dependency's dependency that constraints.txt misses installs at whatever version is newest
    # (narwhals, which scikit-learn needs, was missing until the device payload lacked it).
    from importlib.metadata import distributions

    installed = {canonicalize_name(d.metadata["Name"]) for d in distributions()}
    unpinned = sorted(installed - set(_constraints()) - {"dpdistill", "pip", "setuptools", "wheel"})
    assert not unpinned, f"installed but not in constraints.txt: {unpinned}: add `pip freeze`'s versions"


def test_torch_is_pinned_once_and_by_its_public_version():
    """A local label (2.13.0+cpu) would refuse a CUDA build; the Makefile's torch-first step and
    both images install exactly the constrained version."""
    torch = _constraints()["torch"]
    assert not torch.local, f"constraints.txt pins torch=={torch}: drop the +{torch.local} label"
    for name in ("Makefile", "docker/Dockerfile.cpu", "docker/Dockerfile.cuda"):
        text = (ROOT / name).read_text()
        installs = [line for line in text.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
        assert installs, f"{name} installs nothing"
        for line in installs:
            literal = re.findall(r"torch==([\w.+]+)", line)
            assert literal == [] or literal == [str(torch)], f"{name}: {line.strip()} differs from constraints.txt"
            assert "torch" in line or "-c constraints.txt" in line, f"{name}: {line.strip()} ignores constraints.txt"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_install_reads_torch_from_the_constraints(tmp_path):
    out = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    torch_first, project = [line for line in out.splitlines() if " install " in line]
    assert torch_first.split()[3] == f"torch=={_constraints()['torch']}", torch_first
    assert "-c constraints.txt" in project and '".[dev]"' in project, project
