"""What an install provides: pyproject's package list covers the tree (a package left out is
missing from a regular install, though an editable one still finds it), and the kernels' folder
installs under its own name without shadowing Hugging Face's ``kernels``."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS_NAME, KERNELS_DIR = "rollout_engine_kernels", "kernels"


def _setuptools() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _packages_in_tree() -> set[str]:
    found = set()
    for top, name in (("rollout_engine", "rollout_engine"), ("trainer_bridge", "trainer_bridge"),
                      (KERNELS_DIR, KERNELS_NAME)):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join((name, *rel.parts)))
    return found


def test_every_package_is_listed_and_every_listed_package_exists() -> None:
    listed = set(_setuptools()["packages"])
    assert listed == _packages_in_tree(), (
        "pyproject.toml [tool.setuptools] packages disagrees with the tree: add "
        f"{sorted(_packages_in_tree() - listed)}, remove {sorted(listed - _packages_in_tree())}")


def test_the_kernels_folder_installs_under_its_own_name() -> None:
    assert _setuptools()["package-dir"] == {KERNELS_NAME: KERNELS_DIR}
    # a regular package named `kernels` would shadow Hugging Face's, which transformers imports
    assert not (ROOT / KERNELS_DIR / "__init__.py").exists()
    assert list((ROOT / KERNELS_DIR / "cpu").glob("*.cpp")), "the C++ sources moved"


def test_import_kernels_from_the_checkout_is_not_ours() -> None:
    # transformers requires Hugging Face's kernels: it is installed wherever the engine is
    assert importlib.metadata.distribution("kernels") is not None
    code = "import kernels; print(getattr(kernels, '__file__', None))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120,
                         capture_output=True, text=True).stdout.strip()
    assert out != "None" and not Path(out).resolve().is_relative_to(ROOT), out
