import json

import pytest

from rexrag_jax.retrieval.corpus import CorpusError, iter_corpus, read_corpus, split_title
from rexrag_jax.retrieval.format import format_passages


def test_wiki18_sample(shared_data):
    ps = read_corpus(shared_data / "corpus" / "wiki18_sample_1000.jsonl")
    assert len(ps) == 1000
    assert ps[0].id == "0" and ps[0].contents.startswith('"Evan Morris"\nEvan Morris')
    assert split_title(ps[0].contents)[0] == "Evan Morris"


def test_2wiki_json_list(shared_data):
    path = shared_data / "corpus" / "2wiki_paragraphs.json"
    rows = json.loads(path.read_text())
    ps = list(iter_corpus(path))
    assert len(ps) == len(rows) > 1000
    assert ps[0].contents == f'"{rows[0]["title"]}"\n{rows[0]["text"]}'
    assert [p.id for p in ps[:3]] == ["0", "1", "2"]


def test_title_text_jsonl_and_int_ids(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": 7, "title": "T", "text": "body"}\n\n{"title": "U", "text": "x"}\n')
    ps = read_corpus(p)
    assert [(x.id, x.contents) for x in ps] == [("7", '"T"\nbody'), ("2", '"U"\nx')]


@pytest.mark.parametrize("line,msg", [
    ('{"id": "1", "contents": "a"', "invalid JSON"),
    ('{"id": "1", "text": "a"}', "neither 'contents' nor 'title'"),
    ('{"id": "1", "contents": 5}', "'contents' must be a string"),
    ('[1, 2]', "expected a JSON object"),
    ('{"id": "", "contents": "a"}', "'id' must be a non-empty string"),
    ('{"id": "1", "contents": "\\ud800"}', "unpaired surrogate"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "0", "contents": "\\"A\\"\\nok"}\n' + line + "\n")
    with pytest.raises(CorpusError, match=rf"bad.jsonl:2: .*{msg}"):
        list(iter_corpus(p))


def test_invalid_utf8_and_duplicates(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"id": "0", "contents": "\xff"}\n')
    with pytest.raises(CorpusError, match="u.jsonl:1: invalid UTF-8"):
        list(iter_corpus(p))
    d = tmp_path / "d.jsonl"
    d.write_text('{"id": "a", "contents": "x"}\n{"id": "a", "contents": "y"}\n')
    with pytest.raises(CorpusError, match="duplicate passage id 'a'"):
        read_corpus(d)


def test_format_passages_matches_search_r1():
    hits = [{"document": {"id": "1", "contents": '"Paris"\nParis is the capital.\nSecond line.'}, "score": 0.9},
            {"document": {"id": "2", "contents": '"Lyon"\nLyon text'}, "score": 0.5}]
    want = ('Doc 1(Title: "Paris") Paris is the capital.\nSecond line.\n'
            'Doc 2(Title: "Lyon") Lyon text\n')
    assert format_passages(hits) == want
    assert format_passages([h["document"] for h in hits]) == want  # return_scores=false shape
    assert format_passages([{"id": "3", "contents": "no newline"}]) == "Doc 1(Title: no newline) \n"
    assert format_passages([]) == ""
