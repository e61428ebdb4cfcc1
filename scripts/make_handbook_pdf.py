"""Writes pipelines/data/handbook/admin-guide.pdf: the handbook's PDF page, two pages of text.

    .venv/bin/python scripts/make_handbook_pdf.py [--output FILE]

The PDF is written by hand (:func:`write_pdf`: one Helvetica text stream per page, WinAnsi text, an
information dictionary with the title), so that it needs nothing beyond the standard library and comes out
byte for byte the same on every run; pypdf, which ``inferline index build`` reads PDFs with, extracts its
text page by page. The tests build their PDFs with the same function.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "pipelines" / "data" / "handbook" / "admin-guide.pdf"
TITLE = "Lumen Admin Guide: Verified Domains and SCIM Provisioning"

PAGES = [
    """Lumen Admin Guide

Page 1: Verified domains

A Business workspace can verify the email domains its company owns, such as acme.example. Once a domain is
verified, anyone who signs up with an address on that domain is offered to join the workspace, and admins can
claim existing personal accounts on the domain.

To verify a domain, open Workspace settings > Security > Domains and click Add domain. Lumen shows a DNS TXT
record of the form lumen-verify=4f9c2e. Add it at your DNS provider. Lumen checks for the record every hour
and gives up after 72 hours; start again with a new record if that happens. A workspace can verify up to 20
domains, and a domain can be verified by only one workspace at a time.

Removing a verified domain does not remove anyone from the workspace: it only stops new sign-ups on that
domain from being offered to join.""",
    """Lumen Admin Guide

Page 2: SCIM provisioning

Business workspaces can create and remove members automatically from an identity provider with SCIM 2.0.
Okta, Microsoft Entra ID (formerly Azure AD) and OneLogin are supported. Single sign-on through SAML must be
set up first.

Generate a SCIM token in Workspace settings > Security > SCIM. The token is shown once and is valid for one
year; the SCIM base URL is https://api.lumen.example/scim/v2. Users assigned to the Lumen application in the
identity provider are invited as members; groups become Lumen teams.

When a user is unassigned or deactivated in the identity provider, Lumen suspends the member within 5 minutes:
their sessions end and their API keys stop working, but their notes and tasks stay in the workspace. A
suspended member can be deleted by an admin after 30 days, or restored by assigning them again.""",
]


def write_pdf(path: Path, pages: list[str], title: str | None = None) -> None:
    """A PDF at *path* with one page per text of *pages* and *title*; a page's paragraphs are separated by blank
    lines, and each is wrapped at 95 characters."""
    objects: list[bytes] = []
    page_ids = []
    font_id = 3
    objects += [b"", b"", b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"]
    for text in pages:
        lines = [line for paragraph in text.split("\n\n")
                 for line in [*textwrap.wrap(" ".join(paragraph.split()), 95), ""]]
        body = "".join(f"({_escape(line)}) Tj T*\n" for line in lines)
        stream = f"BT /F1 10 Tf 12 TL 50 760 Td\n{body}ET".encode("cp1252")
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        content_id = len(objects)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 %d 0 R >> >> >>" % (content_id, font_id))
        page_ids.append(len(objects))
    objects[0] = b"<< /Type /Catalog /Pages 2 0 R >>"
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % i for i in page_ids), len(page_ids))
    info_id = None
    if title:
        objects.append(b"<< /Title (%s) >>" % _escape(title).encode("cp1252"))
        info_id = len(objects)
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    info = b" /Info %d 0 R" % info_id if info_id else b""
    out += b"trailer\n<< /Size %d /Root 1 0 R%s >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, info, xref)
    Path(path).write_bytes(bytes(out))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    write_pdf(args.output, PAGES, TITLE)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
