"""MkDocs hooks of the documentation site (``mkdocs.yml``): one source for every text.

* ``<!-- include PATH -->`` (a line of its own) puts the file ``PATH`` (relative to the
  repository root) into the page; ``<!-- include PATH "## Heading" -->`` only the section
  under the first heading that starts with that text (up to the next heading of its level
  or higher). ``schema/FORMAT.md`` and the README's sections are shown this way, never copied.
* Relative links (in pages and in what they include) are resolved against the file they
  are written in and pointed at the page that shows the target: ``../schema/FORMAT.md``
  becomes ``format.md``; a repository file the site does not show becomes its path as
  code. A link to a file that does not exist fails the build.
* reST roles left in docstrings (``:class:`~ucp_zarr.Shard```) render as code.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent
DOCS = "docs"
SHOWN = {"schema/FORMAT.md": "format.md", "README.md": "index.md"}
"""Repository files outside ``docs/`` that a page shows whole, and that page."""

_INCLUDE = re.compile(r'^<!-- include (\S+)(?: "([^"]+)")? -->$', re.M)
_LINK = re.compile(r'(!?\[[^\]\n]*\]\()([^)\s]+)((?:\s+"[^"]*")?\))')
_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>~?([\w.]+)</code>")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    where = f"{DOCS}/{page.file.src_uri}"
    markdown = _INCLUDE.sub(lambda m: _include(m.group(1), m.group(2), page.file.src_uri, where), markdown)
    return _rewrite_links(markdown, where, page.file.src_uri)


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(lambda m: f"<code>{m.group(1).rsplit('.', 1)[-1]}</code>", html)


def _include(path: str, heading: str | None, page_uri: str, where: str) -> str:
    source = ROOT / path
    if not source.is_file():
        raise PluginError(f"{where}: cannot include {path}: no such file")
    text = source.read_text()
    if heading is not None:
        text = _section(text, heading, f"{where}: include {path}")
    return _rewrite_links(text, path, page_uri)


def _section(text: str, heading: str, what: str) -> str:
    """The section of ``text`` under the first heading starting with ``heading``."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines(keepends=True)
    outside = _outside_fences(text)
    start = next((i for i, line in enumerate(lines) if line.startswith(heading) and outside(lines, i)), None)
    if start is None:
        raise PluginError(f"{what}: no heading starting with {heading!r}")
    end = len(lines)
    for i in range(start + 1, len(lines)):
        m = re.match(r"(#+) ", lines[i])
        if m and len(m.group(1)) <= level and outside(lines, i):
            end = i
            break
    return "".join(lines[start:end])


def _outside_fences(text: str) -> Any:
    """A test whether line ``i`` lies outside fenced code blocks."""
    spans = [(text.count("\n", 0, m.start()), text.count("\n", 0, m.end())) for m in _FENCE.finditer(text)]
    return lambda _lines, i: not any(a <= i <= b for a, b in spans)


def _rewrite_links(markdown: str, source: str, page_uri: str) -> str:
    """Rewrite the relative links of ``markdown`` (written in the repository file ``source``)
    for the page ``page_uri``; fenced code is left alone."""
    out, last = [], 0
    for m in _FENCE.finditer(markdown):
        out.append(_LINK.sub(lambda l: _link(l, source, page_uri), markdown[last : m.start()]))
        out.append(m.group())
        last = m.end()
    out.append(_LINK.sub(lambda l: _link(l, source, page_uri), markdown[last:]))
    return "".join(out)


def _link(m: re.Match[str], source: str, page_uri: str) -> str:
    target = m.group(2)
    if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):  # a URL, an anchor of this page, an absolute path
        return m.group()
    path, _, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if not (ROOT / repo_path).exists():
        raise PluginError(f"{source}: the link {target!r} names {repo_path}, which does not exist")
    if repo_path.startswith(f"{DOCS}/"):
        site_uri = repo_path[len(DOCS) + 1 :]
    elif repo_path in SHOWN:
        site_uri = SHOWN[repo_path]
    else:  # a repository file the site does not show: its path, as code
        text = re.sub(r"^!?\[|\]\($", "", m.group(1))
        return text if text.strip("`") == repo_path else f"{text} (`{repo_path}`)"
    relative = posixpath.relpath(site_uri, posixpath.dirname(page_uri) or ".")
    return f"{m.group(1)}{relative}{'#' + anchor if anchor else ''}{m.group(3)}"
