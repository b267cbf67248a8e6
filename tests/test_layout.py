"""The top level of hf_blockdiff is the library: commands built on it live in `hf_blockdiff.tools`, bridges to other
workflows in `hf_blockdiff.integrations`, and the library never imports either."""

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_blockdiff
import hf_blockdiff.integrations
import hf_blockdiff.kernels
import hf_blockdiff.tools

TOOLS = ("bench", "bench_models", "demo", "train_tiny", "tasks", "microbench")
INTEGRATIONS = ("completions", "distributed", "checkpoint", "callbacks")


def modules(package) -> set[str]:
    """Names of the modules in the package's own directory (an editable install of another checkout can still
    make `import hf_blockdiff.bench` find that checkout's file, so the directory is what is checked)."""
    return {module.name for module in pkgutil.iter_modules(package.__path__)}


def test_the_top_level_holds_no_tool_modules():
    assert not modules(hf_blockdiff) & set(TOOLS + INTEGRATIONS)
    assert "microbench" not in modules(hf_blockdiff.kernels)
    assert set(TOOLS) <= modules(hf_blockdiff.tools)
    assert set(INTEGRATIONS) | {"lm_eval"} <= modules(hf_blockdiff.integrations)


@pytest.mark.parametrize("module", [f"hf_blockdiff.tools.{n}" for n in TOOLS]
                         + [f"hf_blockdiff.integrations.{n}" for n in INTEGRATIONS])
def test_tools_and_integrations_import(module):
    importlib.import_module(module)


def test_the_library_imports_no_tool():
    """Importing the package (and its public callback) loads nothing from tools/ or the server (nor the server's
    stack) and only the callback's own integrations."""
    code = ("import sys, hf_blockdiff; hf_blockdiff.BlockDiffusionEvalCallback; print(' '.join(m for m in sys.modules "
            "if m.startswith(('hf_blockdiff.tools', 'hf_blockdiff.integrations', 'hf_blockdiff.serve', 'fastapi'))))")
    root = Path(hf_blockdiff.__file__).parents[1]
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=root).stdout.split()
    assert not [m for m in loaded if m.startswith(("hf_blockdiff.tools", "hf_blockdiff.serve", "fastapi"))]
    assert set(loaded) <= {f"hf_blockdiff.integrations{s}" for s in ("", ".callbacks", ".compile_cache", ".distributed",
                                                                  ".completions")}


def test_the_callback_stays_at_the_top():
    import hf_blockdiff
    from hf_blockdiff.integrations.callbacks import BlockDiffusionEvalCallback

    assert hf_blockdiff.BlockDiffusionEvalCallback is BlockDiffusionEvalCallback


def test_the_root_holds_the_entry_points_only():
    """One folder per capability: the root keeps the public names, the command and the patching entry point."""
    root = Path(hf_blockdiff.__file__).parent
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "cli.py", "patching.py"]
    assert {"canvas", "config", "fusion", "strategies", "weights"} <= modules(hf_blockdiff)
    assert {"checkpoint", "calls", "caches", "masks"} <= modules(importlib.import_module(
        "hf_blockdiff.model_patches.released"))


@pytest.mark.parametrize("old", sorted(hf_blockdiff.MOVED))
def test_a_moved_module_names_its_new_place(old):
    new = f"hf_blockdiff.{hf_blockdiff.MOVED[old]}"
    importlib.import_module(new)  # the new place exists
    with pytest.raises(ImportError, match=f"hf_blockdiff.{old} moved to {new}"):
        importlib.import_module(f"hf_blockdiff.{old}")
    package, _, name = f"hf_blockdiff.{old}".rpartition(".")
    with pytest.raises(ImportError, match=f"moved to {new}"):
        exec(f"from {package} import {name}")
