"""benchmarks/readme.py: how every benchmark script writes its tables into its README."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.readme
from benchmarks.readme import replace_block, write_block

README = "# Bench\n\nProse.\n\n<!-- results:start -->\n| old |\n<!-- results:end -->\n\nMore prose.\n"


def test_only_the_block_between_its_markers_is_replaced(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README)
    write_block(readme, "results", "| a \\1 b |\n| c |")  # taken as it is: a backslash is no group reference
    assert readme.read_text() == README.replace("| old |", "| a \\1 b |\n| c |")


def test_a_missing_block_is_appended_under_its_heading_or_refused() -> None:
    text = replace_block(README, "hetero", "| h |", heading="Heterogeneous clusters")
    assert (
        text == README.rstrip() + "\n\n## Heterogeneous clusters\n\n<!-- hetero:start -->\n| h |\n<!-- hetero:end -->\n"
    )
    assert replace_block(text, "hetero", "| i |", heading="Heterogeneous clusters").count("## Heterogeneous") == 1
    with pytest.raises(ValueError, match=r"no '<!-- hetero:start -->' \.\.\. '<!-- hetero:end -->' markers"):
        replace_block(README, "hetero", "| h |")
