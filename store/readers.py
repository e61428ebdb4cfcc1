"""Text out of the files an index reads: Markdown and plain text, PDF, HTML and Word (DOCX).

Every reader gives a :class:`Parsed` document: its text (HTML and DOCX become Markdown-like text, headings
as ``#`` lines and tables as ``|``-separated rows, so that a table stays searchable), a title when the file
names one, the characters at which each PDF page starts (so that a chunk knows its page), and the YAML front
matter of a Markdown or text file. A file that cannot be read raises :class:`Unreadable` with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TEXT_SUFFIXES = (".md", ".markdown", ".txt", ".rst", ".text")
PDF_SUFFIXES = (".pdf",)
HTML_SUFFIXES = (".html", ".htm")
DOCX_SUFFIXES = (".docx",)
#: Every suffix ``index build`` and ``index add`` read.
SUFFIXES = TEXT_SUFFIXES + PDF_SUFFIXES + HTML_SUFFIXES + DOCX_SUFFIXES

_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)^(?:---|\.\.\.)[ \t]*(?:\r?\n|\Z)", re.S | re.M)
# Page furniture, not content: menus, scripts and footers would otherwise be indexed with every page.
_HTML_DROP = ("script", "style", "noscript", "template", "nav", "footer", "header", "aside", "form", "svg")
_HTML_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_HTML_BLOCKS = ("p", "pre", "blockquote", "dt", "dd", "figcaption", "caption", "address")


class Unreadable(Exception):
    """A file that is skipped: broken, encrypted, or without text; the message says which."""


@dataclass(slots=True)
class Parsed:
    """A file's text and what the reader learnt of it."""

    text: str
    title: str | None = None
    #: The character offset at which each page starts (PDF): page n starts at ``pages[n - 1]``.
    pages: list[int] = field(default_factory=list)
    #: The file's own metadata (a Markdown file's front matter).
    metadata: dict[str, Any] = field(default_factory=dict)


def read_file(path: Path) -> Parsed:
    """*path* as text, by its suffix; raises :class:`Unreadable`."""
    suffix = path.suffix.lower()
    if suffix in PDF_SUFFIXES:
        return read_pdf(path)
    if suffix in HTML_SUFFIXES:
        return read_html(path.read_bytes())
    if suffix in DOCX_SUFFIXES:
        return read_docx(path)
    return read_text(path.read_bytes().decode("utf-8", errors="replace"))


def read_text(text: str) -> Parsed:
    """Markdown or plain text; YAML front matter (between ``---`` lines) becomes metadata."""
    match = _FRONT_MATTER.match(text)
    if match is None:
        return Parsed(text, heading_title(text))
    try:
        metadata = yaml.safe_load(match.group(1))
    except yaml.YAMLError as exc:
        raise Unreadable(f"front matter is not valid YAML: {' '.join(str(exc).split())}") from None
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise Unreadable("front matter must be a mapping of names to values")
    body = text[match.end():]
    title = metadata.pop("title", None)
    return Parsed(body, str(title) if title else heading_title(body), metadata={str(k): v for k, v in metadata.items()})


def heading_title(text: str) -> str | None:
    """The text of a leading ``# `` heading (the first line that is not blank), if there is one."""
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
        if line.strip():
            break
    return None


def read_pdf(path: Path) -> Parsed:
    """Each page's text, pages joined by a blank line; the PDF's title from its document information."""
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):  # many PDFs are encrypted with an empty password
            raise Unreadable("encrypted (it needs a password)")
        texts = [(page.extract_text() or "").strip() for page in reader.pages]
        info = reader.metadata
        title = (info.title if info is not None else None) or None
    except Unreadable:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, OSError, AttributeError, IndexError) as exc:
        # pypdf raises a range of errors on damaged files; each means the same here: not readable.
        raise Unreadable(f"not a readable PDF ({type(exc).__name__}: {exc})") from None
    if not any(texts):
        raise Unreadable("no text in the PDF (a scan? run OCR on it first)")
    pages, parts, offset = [], [], 0
    for text in texts:
        pages.append(offset)
        parts.append(text)
        offset += len(text) + 2
    return Parsed("\n\n".join(parts), str(title).strip() if title else None, pages)


def read_html(data: bytes) -> Parsed:
    """The page's text as Markdown-like blocks; its ``<title>``, else its first ``<h1>``, is the title."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(data, "html.parser")
    for tag in soup.find_all(_HTML_DROP):
        tag.decompose()
    title_tag = soup.find("title")
    title = _clean(title_tag.get_text()) if title_tag else ""
    if not title and (h1 := soup.find("h1")) is not None:
        title = _clean(h1.get_text())
    root = soup.body or soup
    blocks = list(_html_blocks(root))
    return Parsed("\n\n".join(b for b in blocks if b), title or None)


def _html_blocks(node: Any) -> Any:
    from bs4 import NavigableString, Tag

    for child in node.children:
        if isinstance(child, NavigableString):
            if type(child) is NavigableString and child.strip():  # not a comment or a doctype
                yield _clean(child)
            continue
        if not isinstance(child, Tag) or child.name == "title":
            continue
        name = child.name
        if name in _HTML_HEADINGS:
            yield "#" * _HTML_HEADINGS[name] + " " + _clean(child.get_text(" "))
        elif name == "table":
            yield "\n".join(" | ".join(_clean(cell.get_text(" ")) for cell in row.find_all(["th", "td"]))
                            for row in child.find_all("tr"))
        elif name == "li":
            yield "- " + _clean(child.get_text(" "))
        elif name in _HTML_BLOCKS:
            yield _clean(child.get_text(" "))
        elif child.find(["p", "div", "li", "table", "section", "article", *_HTML_HEADINGS]) is not None:
            yield from _html_blocks(child)
        elif text := _clean(child.get_text(" ")):
            yield text


def read_docx(path: Path) -> Parsed:
    """Paragraphs and tables in document order; ``Heading N`` styles become ``#`` lines, tables ``|`` rows."""
    import docx
    from docx.opc.exceptions import PackageNotFoundError
    from docx.table import Table

    try:
        document = docx.Document(str(path))
    except (PackageNotFoundError, KeyError, ValueError, OSError) as exc:
        raise Unreadable(f"not a readable DOCX file ({type(exc).__name__}: {exc})") from None
    blocks, title = [], (document.core_properties.title or "").strip()
    for item in document.iter_inner_content():
        if isinstance(item, Table):
            blocks.append("\n".join(" | ".join(_clean(cell.text) for cell in row.cells) for row in item.rows))
            continue
        text = _clean(item.text)
        if not text:
            continue
        style = item.style.name if item.style is not None else ""
        level = 1 if style == "Title" else int(m.group(1)) if (m := re.fullmatch(r"Heading (\d)", style)) else 0
        if level:
            title = title or (text if level == 1 else "")
            blocks.append("#" * level + " " + text)
        elif style.startswith("List"):
            blocks.append("- " + text)
        else:
            blocks.append(text)
    return Parsed("\n\n".join(blocks), title or None)


def _clean(text: str) -> str:
    return " ".join(text.split())


__all__ = ["SUFFIXES", "TEXT_SUFFIXES", "Parsed", "Unreadable", "heading_title", "read_docx", "read_file",
           "read_html", "read_pdf", "read_text"]
