"""Reading documents: each format, typed metadata, and the files that are skipped with a reason."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from store.documents import read_documents
from store.readers import read_file

ROOT = Path(__file__).resolve().parents[2]


def _pdf_writer():
    spec = importlib.util.spec_from_file_location("make_handbook_pdf", ROOT / "scripts" / "make_handbook_pdf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_pdf


write_pdf = _pdf_writer()


def write_docx(path: Path) -> None:
    import docx

    document = docx.Document()
    document.core_properties.title = "Price list"
    document.add_heading("Price list", level=1)
    document.add_paragraph("Hardware we sell with Lumen Business.")
    table = document.add_table(rows=3, cols=3)
    for row, cells in zip(table.rows, [("Code", "Item", "Price"), ("LX-4410", "Desk dock", "$129"),
                                       ("LX-7720", "Meeting camera", "$349")], strict=True):
        for cell, text in zip(row.cells, cells, strict=True):
            cell.text = text
    document.add_heading("Shipping", level=2)
    document.add_paragraph("Orders ship within two days.")
    document.save(str(path))


def test_a_two_page_pdf_keeps_its_pages_and_title(tmp_path):
    write_pdf(tmp_path / "guide.pdf", ["The first page is about domains.", "The second page is about SCIM."],
              "Admin guide")
    parsed = read_file(tmp_path / "guide.pdf")
    assert parsed.title == "Admin guide" and len(parsed.pages) == 2
    assert "SCIM" in parsed.text[parsed.pages[1]:] and "SCIM" not in parsed.text[:parsed.pages[1]]


def test_a_docx_keeps_headings_as_titles_and_tables_as_rows(tmp_path):
    write_docx(tmp_path / "prices.docx")
    parsed = read_file(tmp_path / "prices.docx")
    assert parsed.title == "Price list"
    assert "# Price list" in parsed.text and "## Shipping" in parsed.text
    assert "LX-4410 | Desk dock | $129" in parsed.text


def test_html_drops_page_furniture_and_keeps_headings_lists_and_tables(tmp_path):
    (tmp_path / "page.html").write_text(
        "<html><head><title>Release notes</title><script>var x = 1;</script></head><body>"
        "<nav>Home | Download</nav><h1>Notes</h1><p>Focus mode arrived.</p><ul><li>Dark mode</li></ul>"
        "<table><tr><th>Version</th><th>Date</th></tr><tr><td>5.2</td><td>March</td></tr></table>"
        "<footer>Company</footer></body></html>")
    parsed = read_file(tmp_path / "page.html")
    assert parsed.title == "Release notes"
    assert parsed.text.split("\n\n") == ["# Notes", "Focus mode arrived.", "- Dark mode", "Version | Date\n5.2 | March"]


def test_front_matter_and_metadata_json_become_typed_metadata(tmp_path):
    (tmp_path / "a.md").write_text("---\ntitle: Alpha\ntenant: acme\nupdated: 2025-03-01\n---\n\nAlpha text.")
    (tmp_path / "b.txt").write_text("Beta text.")
    (tmp_path / "metadata.json").write_text(json.dumps({"a.md": {"version": "4", "tenant": "other"},
                                                        "b.txt": {"tenant": "globex", "tags": "billing"}}))
    fields = {"tenant": "string", "updated": "date", "version": "number", "tags": "list"}
    scan = read_documents(tmp_path, fields)
    a, b = scan.documents
    assert (a.title, a.metadata) == ("Alpha", {"version": 4, "tenant": "acme", "updated": "2025-03-01"})
    assert b.metadata == {"tenant": "globex", "tags": ["billing"]}


def test_broken_encrypted_and_mistyped_files_are_skipped_with_the_reason(tmp_path):
    from pypdf import PdfReader, PdfWriter

    (tmp_path / "good.md").write_text("# Good\n\nReadable.")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\nthis is not really a PDF\n%%EOF\n")
    write_pdf(tmp_path / "plain.pdf", ["Secret plans."])
    writer = PdfWriter(clone_from=PdfReader(tmp_path / "plain.pdf"))
    writer.encrypt("hunter2")
    writer.write(tmp_path / "locked.pdf")
    (tmp_path / "plain.pdf").unlink()
    (tmp_path / "dated.md").write_text("---\nupdated: someday\n---\n\nText.")
    scan = read_documents(tmp_path, {"updated": "date"})
    assert [d.doc_id for d in scan.documents] == ["good"]
    reasons = dict(scan.skipped)
    assert set(reasons) == {"broken.pdf", "locked.pdf", "dated.md"}
    assert "not a readable PDF" in reasons["broken.pdf"]
    assert "encrypted" in reasons["locked.pdf"]
    assert "expected a date" in reasons["dated.md"]


def test_two_files_with_one_id_are_refused(tmp_path):
    (tmp_path / "guide.md").write_text("a")
    (tmp_path / "guide.txt").write_text("b")
    with pytest.raises(ValueError, match="both be document 'guide'"):
        read_documents(tmp_path)


def test_the_handbook_pdf_is_the_scripts_output(tmp_path):
    """The committed PDF is what scripts/make_handbook_pdf.py writes: regenerate it after editing the script."""
    spec = importlib.util.spec_from_file_location("make_handbook_pdf", ROOT / "scripts" / "make_handbook_pdf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--output", str(tmp_path / "guide.pdf")])
    assert (tmp_path / "guide.pdf").read_bytes() == module.OUTPUT.read_bytes()
    assert len(read_file(module.OUTPUT).pages) == 2
