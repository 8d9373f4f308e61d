"""The fence holds: only profiles/internals.py reaches Keras and TensorFlow internals, and the installed
Keras and TensorFlow are inside the range pyproject.toml states. Reads source and metadata: no TensorFlow."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from profiles.internals import PRIVATE_NAMES

ROOT = Path(__file__).resolve().parents[2]
FENCE = Path("profiles/internals.py")
PACKAGES = ("partitioner", "profiles", "runtime", "examples", "benchmarks")
PRIVATE_MODULES = ("keras.src", "tensorflow.python")


def _is_private_module(name: str | None) -> bool:
    return name is not None and any(name == m or name.startswith(m + ".") for m in PRIVATE_MODULES)


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def reaches(source: str) -> list[str]:
    """What ``source`` reaches behind the fence: 'line N: why' for each private module imported, each
    name of PRIVATE_NAMES read as an attribute or named in a string (getattr, hasattr), and each attribute
    of ``keras`` or ``tensorflow`` assigned (a class patched)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if _is_private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and _is_private_module(node.module):
            found.append(f"line {node.lineno}: imports from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            found.append(f"line {node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES:
            found.append(f"line {node.lineno}: names {node.value!r}")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _root_name(target) in {"keras", "tf", "tensorflow"}:
                    found.append(f"line {node.lineno}: assigns {ast.unparse(target)}")
    return found


def test_internals_only_the_fence_reaches_keras_and_tensorflow_internals():
    files = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    assert len(files) > 50  # the packages were found (a wrong root would scan nothing)
    outside = {
        str(path.relative_to(ROOT)): hits
        for path in files
        if path.relative_to(ROOT) != FENCE and (hits := reaches(path.read_text(encoding="utf-8")))
    }
    assert outside == {}, "call profiles/internals.py instead (add a function there, with why and the versions)"


def test_internals_the_fence_uses_every_name_it_lists():
    # A name the fence no longer reads is a stale entry: drop it from PRIVATE_NAMES (whose own strings do not count).
    module = ast.parse((ROOT / FENCE).read_text(encoding="utf-8"))
    module.body = [s for s in module.body if "PRIVATE_NAMES" not in ast.unparse(s).split("=")[0]]
    hits = reaches(ast.unparse(module))
    used = {h.split(".")[-1] for h in hits if "reads ." in h} | {h.split("'")[1] for h in hits if "names '" in h}
    assert sorted(PRIVATE_NAMES - used) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from keras.src.backend import set_keras_mask", "line 1: imports from keras.src.backend"),
        ("import keras.src.models.functional as f", "line 1: imports keras.src.models.functional"),
        ("from tensorflow.python.eager import context", "line 1: imports from tensorflow.python.eager"),
        ("layers = model._flatten_layers()", "line 1: reads ._flatten_layers"),
        ("x = 1\nok = hasattr(layer, '_call_context_args')", "line 2: names '_call_context_args'"),
        ("keras.layers.Embedding.call = call", "line 1: assigns keras.layers.Embedding.call"),
    ],
)
def test_internals_the_check_finds_each_kind_of_reach(source, expected):
    assert reaches(source) == [expected]


def test_internals_the_check_leaves_the_projects_own_names_alone():
    assert reaches("import keras\nself._state = 1\nx = obj._memo\nlayer.call = f\nkeras.ops.copy(x)") == []


def _stated_range(name: str) -> SpecifierSet:
    """The one specifier set the [cpu] and [gpu] extras state for ``name`` (tensorflow: every TF package)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    requirements = [Requirement(r) for extra in ("cpu", "gpu") for r in extras[extra]]
    stated = {str(r.specifier) for r in requirements if r.name.split("-")[0] == name}
    assert len(stated) == 1, f"the extras state different ranges for {name}: {sorted(stated)}"
    return SpecifierSet(stated.pop())


def _installed_version(module: str) -> str:
    """The version of the distribution that provides the importable ``module`` (keras; tensorflow comes as
    tensorflow, tensorflow-cpu, ...)."""
    distributions = importlib.metadata.packages_distributions().get(module, [])
    assert distributions, f"no installed distribution provides {module!r}"
    return importlib.metadata.version(distributions[0])


@pytest.mark.parametrize(("name", "next_major"), [("keras", "4"), ("tensorflow", "3")])
def test_internals_installed_versions_are_in_the_stated_range(name, next_major):
    stated = _stated_range(name)
    assert any(s.operator == "<" and s.version == next_major for s in stated), f"{name}: no bound below {next_major}"
    installed = _installed_version(name)
    assert stated.contains(installed, prereleases=True), (
        f"{name} {installed} is installed, outside the tested range {stated} of pyproject.toml: install a version "
        "inside it, or check profiles/internals.py against this one and widen the range"
    )


def test_internals_the_stated_range_leaves_out_keras_without_the_internals():
    # Keras 3.3.3 has no keras.src.backend.set_keras_mask nor Layer._call_context_args (read in its wheel)
    assert not _stated_range("keras").contains("3.3.3")
    assert _stated_range("keras").contains("3.15.1")
