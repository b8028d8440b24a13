"""The benchmark tables of the documentation, printed from the committed reports at build time.

A page holds a block such as::

    <!-- fastfeed bench --from docs/bench/standard.json --markdown transport overhead -->
    ...the tables...
    <!-- end -->

When Sphinx reads the page, the block's body is replaced by what ``fastfeed bench --from REPORT --markdown NAMES``
prints (``fastfeed.bench.report.markdown``), so the site always shows the committed report's figures. The same
blocks are what tests/test_bench_cli.py checks in the Markdown files themselves (their text equals the report's),
so the pages read on GitHub show the same tables.
"""

from __future__ import annotations

import re
from pathlib import Path

BLOCK = re.compile(r"(<!-- fastfeed bench --from (\S+) --markdown ?([^>]*?) -->\n)(.*?)(\n<!-- end -->)", re.S)


def _fill(app, docname, source):
    from fastfeed.bench import report

    repo = Path(app.srcdir).parent

    def table(match):
        path = repo / match.group(2)
        app.env.note_dependency(str(path))
        body = report.markdown(report.load(path), match.group(3).split() or None)
        return match.group(1) + body + match.group(5)

    source[0] = BLOCK.sub(table, source[0])


def setup(app):
    app.connect("source-read", _fill)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
