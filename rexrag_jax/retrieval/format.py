"""Search-R1 observation formatting of retrieved passages (SPEC §1)."""
from __future__ import annotations


def format_passages(hits) -> str:
    """`Doc {k}(Title: {first line of contents}) {rest of contents}\\n` per hit, k from 1.

    `hits` is one query's result list: items `{"document": {"id", "contents"}, "score"}` or bare
    documents `{"id", "contents"}` (the server's `return_scores=false` shape). As in Search-R1, the
    first line is used verbatim (wiki-18 titles keep their quotes: `Doc 1(Title: "Paris") ...`).
    """
    out = []
    for k, hit in enumerate(hits, start=1):
        doc = hit["document"] if "document" in hit else hit
        contents = doc["contents"]
        title, _, text = contents.partition("\n")
        out.append(f"Doc {k}(Title: {title}) {text}\n")
    return "".join(out)
