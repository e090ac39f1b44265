"""capability/model is model code only: the loaders that read files live in capability/bundle."""

from __future__ import annotations

import ast
from pathlib import Path

import capability.model

MODEL_PACKAGE = Path(capability.model.__file__).parent
# Modules that read or write files, and calls that do.
FILE_MODULES = {"pathlib", "json", "os", "shutil", "safetensors", "classify_common.documents"}
FILE_CALLS = {"open", "from_file", "load_file", "save_file", "load", "save"}


def _file_access(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in FILE_CALLS:
                found.append(f"line {node.lineno}: calls {name}()")
            continue
        else:
            continue
        found += [
            f"line {node.lineno}: imports {name}"
            for name in names
            if name in FILE_MODULES or name.split(".")[0] in FILE_MODULES
        ]
    return found


def test_no_model_module_imports_or_calls_a_file_reader() -> None:
    offences = {
        path.name: found
        for path in sorted(MODEL_PACKAGE.glob("*.py"))
        if (found := _file_access(path.read_text(encoding="utf-8")))
    }
    assert offences == {}
