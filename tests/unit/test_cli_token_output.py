"""``tokenize --out``: what it would overwrite that is not its own token file is refused, before any token is
written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_async_pp.cli import main


def _tokenize(*args) -> None:
    main(["tokenize", *map(str, args)])


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("some text\n")
    return path


def test_out_named_like_its_header_is_refused(tmp_path, doc):
    with pytest.raises(ValueError, match=r"The token file cannot be .*x\.json: its header .* e\.g\. .*x\.bin"):
        _tokenize(doc, "--out", tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_an_unrelated_file_where_the_header_goes_is_kept(tmp_path, doc):
    (tmp_path / "foo.json").write_text('{"settings": 1}\n')
    with pytest.raises(FileExistsError, match=r"foo\.json exists and is not the header of a token file"):
        _tokenize(doc, "--out", tmp_path / "foo.bin")
    assert (tmp_path / "foo.json").read_text() == '{"settings": 1}\n' and not (tmp_path / "foo.bin").exists()


@pytest.mark.parametrize("which", ["file", "in-a-folder", "header"])
def test_out_that_is_a_source_is_refused(tmp_path, which):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("alpha\n")
    (corpus / "b.jsonl").write_text(json.dumps({"text": "beta"}) + "\n")
    source, out = {
        "file": (corpus / "a.txt", corpus / "a.txt"),
        "in-a-folder": (corpus, corpus / "b.jsonl"),
        "header": (corpus / "c.json", corpus / "c.bin"),  # a source given by name is read whatever its suffix
    }[which]
    (corpus / "c.json").write_text("gamma\n")
    before = {p.name: p.read_bytes() for p in corpus.iterdir()}
    with pytest.raises(ValueError, match=r"is one of the sources, and writing (the token file|its header) there"):
        _tokenize(source, "--out", out)
    assert {p.name: p.read_bytes() for p in corpus.iterdir()} == before


def test_an_earlier_token_file_is_rewritten(tmp_path, doc):
    _tokenize(doc, "--out", tmp_path / "t.bin")
    doc.write_text("other, longer text\n")
    _tokenize(doc, "--out", tmp_path / "t.bin")
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist() == [*b"other, longer text\n", 256]
