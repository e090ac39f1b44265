"""Build hook of classify-client: generate the stubs into the wheel.

The package's sources hold no generated code. `build_py` copies them, then runs
the repository's tools/protoc.py to write the stubs of ../../proto (and of
buf/validate/validate.proto, which their field options need) under
classify_client/gen in the build tree, so each wheel carries stubs made from
the contract it was built from.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
GENERATOR = REPO_ROOT / "tools" / "protoc.py"


class BuildPyWithStubs(build_py):  # type: ignore[misc]  # setuptools ships no type hints
    """build_py, then the generated stubs under classify_client/gen."""

    def run(self) -> None:
        super().run()
        if not GENERATOR.is_file():
            raise SystemExit(f"{GENERATOR} not found: build classify-client from the repository")
        out = Path(self.build_lib) / "classify_client" / "gen"
        subprocess.run(
            [sys.executable, str(GENERATOR), "client-stubs", "--out", str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
        )


setup(cmdclass={"build_py": BuildPyWithStubs})
