"""How every benchmark writes its tables into its README: between a pair of markers, the rest kept as written.

A benchmark's README is prose by hand with generated blocks in it, each between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->``. A script that measured rewrites its blocks and nothing else:

    >>> replace_block("Prose.\\n<!-- results:start -->\\nold\\n<!-- results:end -->\\nMore.", "results", "| new |")
    'Prose.\\n<!-- results:start -->\\n| new |\\n<!-- results:end -->\\nMore.'

Scripts import it with the repository root on ``sys.path`` (``from benchmarks.readme import write_block``).
"""

from __future__ import annotations

import re
from pathlib import Path


def replace_block(text: str, marker: str, block: str, *, heading: str | None = None) -> str:
    """``text`` with what stands between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` replaced by
    ``block`` (taken as it is: no backslash or group in it is read). Where the markers are missing, with
    ``heading`` a new section is appended (``## heading`` and the block between its markers); without, raises
    ValueError, as a README that lost its markers by hand would otherwise keep its old tables unnoticed."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    generated = f"{start}\n{block}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), flags=re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: generated, text, count=1)
    if heading is None:
        raise ValueError(
            f"The README has no '{start}' ... '{end}' markers to write the benchmark's table between. Expected "
            "both, on lines of their own, where the table goes. Put them back (the table is written between them)."
        )
    return f"{text.rstrip()}\n\n## {heading}\n\n{generated}\n"


def write_block(readme: Path, marker: str, block: str, *, heading: str | None = None) -> None:
    """Rewrites ``readme`` with its ``marker`` block replaced by ``block`` (:func:`replace_block`)."""
    readme.write_text(replace_block(readme.read_text(), marker, block, heading=heading))
