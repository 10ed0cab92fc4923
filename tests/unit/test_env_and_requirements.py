"""What the package declares about its surroundings, checked against the source: every environment
variable it (or its build, tests and scripts) reads or sets is listed in ``lightning_recover/env.py``, and
the torch it requires (pyproject.toml and the import-time check) is one whose ``weights_only`` loader is safe.
Fast: reads the source tree."""

from __future__ import annotations

import os
import re

import pytest

from lightning_recover import env, torch_version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = re.compile(r"\b(?:LIGHTNING_RECOVER|NATIVE_IO)_[A-Z0-9_]*[A-Z0-9]\b")  # not a prefix such as `..._ETCD_*`
# C preprocessor symbols share the prefix but are compile-time macros, not environment variables.
MACRO = re.compile(r"#\s*(?:ifdef|ifndef|define|if\s+defined\s*\(?)\s*((?:NATIVE_IO)_[A-Z0-9_]+)")
SOURCES = (".py", ".c", ".h", ".sh", ".toml", ".yml", ".yaml", ".cfg", ".ini")
FOLDERS = ("lightning_recover", "native_io", "tests", "scripts", "examples", ".ci", "benchmarks")


def _source_files():
    yield os.path.join(ROOT, "setup.py")
    yield os.path.join(ROOT, "Makefile")
    for folder in FOLDERS:
        for directory, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "build")]
            for name in files:
                if name.endswith(SOURCES):
                    yield os.path.join(directory, name)


def _names_in_tree() -> tuple[dict[str, str], set[str]]:
    """``{variable: first file naming it}`` and the set of C macros with the same prefixes."""
    names: dict[str, str] = {}
    macros: set[str] = set()
    env_py = os.path.join(ROOT, "lightning_recover", "env.py")
    for path in _source_files():
        if path == env_py or not os.path.exists(path):
            continue
        text = open(path, errors="replace").read()
        macros.update(MACRO.findall(text))
        for name in NAME.findall(text):
            names.setdefault(name, os.path.relpath(path, ROOT))
    return names, macros


def _listed() -> dict[str, str]:
    """``{value: attribute}`` of the string constants of env.py."""
    return {v: k for k, v in vars(env).items() if k.isupper() and isinstance(v, str)}


def test_every_environment_variable_of_the_tree_is_listed_in_env_py():
    names, macros = _names_in_tree()
    assert "NATIVE_IO_TESTING" in macros, "the macro scan found nothing: its pattern no longer matches the C"
    missing = sorted(
        f"{name} (in {where})" for name, where in names.items() if name not in macros and name not in _listed()
    )
    assert not missing, "add these to lightning_recover/env.py with their meaning:\n" + "\n".join(missing)


def test_every_variable_listed_in_env_py_is_used():
    text = "\n".join(open(p, errors="replace").read() for p in _source_files() if os.path.exists(p))
    unused = [
        f"{attr} = {value!r}"
        for value, attr in _listed().items()
        if value not in text and not re.search(rf"\benv\.{attr}\b|\bimport .*\b{attr}\b", text)
    ]
    assert not unused, "env.py lists variables nothing reads or sets:\n" + "\n".join(unused)


def test_pyproject_requires_the_torch_the_import_check_requires():
    found = re.search(r'"torch>=([0-9.]+)"', open(os.path.join(ROOT, "pyproject.toml")).read())
    assert found, "pyproject.toml no longer pins a minimum torch"
    assert torch_version.parse(found.group(1)) == torch_version.MINIMUM == (2, 6)


@pytest.mark.parametrize("version", ["2.4.1", "2.5.1+cu124", "1.13.0"])
def test_a_torch_whose_weights_only_loader_is_unsafe_is_refused_with_a_hint(version):
    with pytest.raises(ImportError, match=r"CVE-2025-32434.*HINT: pip install 'torch>=2.6'"):
        torch_version.check(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", "2.7.0a0+git1234abc", "3.0.0"])
def test_a_safe_torch_is_accepted(version):
    torch_version.check(version)
