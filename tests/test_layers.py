"""The layering rules import-linter cannot state (pyproject.toml holds the rest, run by `lint-imports` in CI), and
the size rules of the code base."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_blockdiff"
MODEL_FREE = [*sorted((PACKAGE / "strategies").glob("*.py")), *sorted((PACKAGE / "scheduler").glob("*.py")),
              PACKAGE / "canvas" / "schedule.py"]


def imported_names(path: Path) -> list[str]:
    """Every module an import statement of `path` names (`from torch import nn` names torch.nn)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", MODEL_FREE, ids=lambda p: p.name)
def test_model_free_modules_import_no_torch_nn(path):
    bad = [name for name in imported_names(path) if name == "torch.nn" or name.startswith(("torch.nn.", "transformers"))]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_the_package_only_relatively(path):
    assert not [name for name in imported_names(path) if name.startswith("hf_blockdiff")]


def test_files_and_functions_stay_small():
    long_files, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 400:
            long_files.append(path.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.name}:{node.name}")
    assert not long_files and not long_functions, (long_files, long_functions)


def test_no_comment_cites_a_document_outside_the_repository():
    cited = [str(path) for path in PACKAGE.rglob("*.py") if "DESIGN §" in path.read_text()]
    assert not cited
