"""``inferline index``: build (a broken PDF skipped and counted), add (gone files removed), remove, search."""

from __future__ import annotations

import json

import pytest

from serving.cli.main import main
from tests.store.test_documents import write_pdf


@pytest.mark.slow
def test_build_add_remove_and_search_from_the_command_line(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "billing.md").write_text("---\ntenant: acme\n---\n# Billing\n\nThe Plus plan costs eight dollars.")
    (docs / "parts.md").write_text("# Parts\n\nThe desk dock is part QZ-7731.")
    write_pdf(docs / "guide.pdf", ["Domains are verified with a TXT record. " * 8,
                                   "SCIM tokens last one year. " * 8], "Admin guide")
    (docs / "broken.pdf").write_bytes(b"%PDF-1.4 not a pdf")
    config = tmp_path / "inferline.yaml"
    config.write_text("indexes:\n  kb: {metadata: {tenant: string}}\n")
    args = ["--config", str(config)]

    assert main(["index", "build", str(docs), "--name", "kb", "--chunk-tokens", "32", "--overlap", "4", *args]) == 0
    out, err = capsys.readouterr()
    assert "3 documents, 1 skipped" in out and "skipped broken.pdf: not a readable PDF" in err

    assert main(["index", "search", "kb", "QZ-7731", "--mode", "keyword", "--json", *args]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["source"] == "parts.md" and first["rank"] == 1
    assert main(["index", "search", "kb", "How long does a SCIM token last?", "--top-k", "1", *args]) == 0
    assert "guide.pdf p. 2" in capsys.readouterr().out

    (docs / "parts.md").unlink()
    assert main(["index", "add", str(docs), "--name", "kb", "--keep-missing", *args]) == 0
    assert "0 removed, 1 skipped" in capsys.readouterr().out
    assert main(["index", "add", str(docs), "--name", "kb", *args]) == 0
    assert "0 added, 0 changed, 2 unchanged, 1 removed, 1 skipped" in capsys.readouterr().out
    assert main(["index", "search", "kb", "QZ-7731", "--mode", "keyword", "--json", *args]) == 0
    assert capsys.readouterr().out == ""  # the gone file's chunks are gone from the keyword side too

    assert main(["index", "remove", "kb", "guide.pdf", *args]) == 0
    assert "1 removed; 1 documents" in capsys.readouterr().out
    assert main(["index", "remove", "kb", "nope", *args]) == 1
    assert "no document 'nope'" in capsys.readouterr().err
    assert main(["index", "info", "kb", *args]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["default_mode"] == "hybrid" and info["fields"]["tenant"] == "string"
