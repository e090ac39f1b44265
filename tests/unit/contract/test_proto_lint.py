"""The contract passes buf lint, and the lint targets really catch faults.

Each test copies proto/ to a temporary directory, plants one fault, and runs
the same make targets CI runs, pointed at the copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import REPO_ROOT, run_make

CLASSIFY_PROTO = Path("ai/classify/v1/classify_service.proto")


def copy_contract(tmp_path: Path) -> Path:
    root = tmp_path / "proto"
    shutil.copytree(REPO_ROOT / "proto", root)
    return root


def plant(root: Path, old: str, new: str) -> None:
    path = root / CLASSIFY_PROTO
    text = path.read_text()
    assert old in text, f"the fault cannot be planted: {old!r} is not in the contract"
    path.write_text(text.replace(old, new, 1))


def test_buf_lint_passes_on_the_contract(tmp_path: Path) -> None:
    result = run_make("buf-lint", f"IMAGE_DIR={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_make_lint_fails_on_a_planted_naming_violation(tmp_path: Path) -> None:
    root = copy_contract(tmp_path)
    plant(root, "optional int32 top_k = 3", "optional int32 topK = 3")

    result = run_make("lint", f"PROTO_ROOT={root}", f"IMAGE_DIR={tmp_path / 'image'}")

    assert result.returncode != 0
    assert 'Field name "topK" should be lower_snake_case' in result.stdout + result.stderr


def test_buf_breaking_flags_a_removed_field(tmp_path: Path) -> None:
    root = copy_contract(tmp_path)
    plant(
        root,
        "  optional int32 top_k = 3 [(buf.validate.field).int32 = {\n"
        "    gte: 1\n"
        "    lte: 100\n"
        "  }];\n",
        "",
    )

    result = run_make(
        "buf-breaking",
        f"PROTO_ROOT={root}",
        f"BUF_AGAINST={REPO_ROOT / 'proto'}",
        f"IMAGE_DIR={tmp_path / 'image'}",
    )

    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert 'Previously present field "3" with name "top_k" on message "ClassifyRequest"' in output


def test_buf_breaking_accepts_an_added_field(tmp_path: Path) -> None:
    root = copy_contract(tmp_path)
    plant(
        root,
        "  bool truncated = 10;\n",
        "  bool truncated = 10;\n  // A new field.\n  string note = 11;\n",
    )

    result = run_make(
        "buf-breaking",
        f"PROTO_ROOT={root}",
        f"BUF_AGAINST={REPO_ROOT / 'proto'}",
        f"IMAGE_DIR={tmp_path / 'image'}",
    )

    assert result.returncode == 0, result.stdout + result.stderr
