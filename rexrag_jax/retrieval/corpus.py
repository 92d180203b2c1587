"""Corpus readers for the Search-R1 passage format.

A passage is `{"id": str, "contents": "\"Title\"\\ntext"}` (wiki-18, SPEC §7). Rows that carry
`title` + `text` instead (2Wiki / HippoRAG paragraph files) are mapped onto the same shape with
`contents = '"' + title + '"\\n' + text`, and get their 0-based row number as id when they have none.

Two file layouts are read:
- JSON lines (`.jsonl`): streamed row by row, never loaded whole.
- one JSON list of objects (`.json`, e.g. 2wiki_paragraphs.json): parsed at once (these files are small).

Every rejected row raises `CorpusError` naming `file:line` and what was expected.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterator

from rexrag_jax.io import paths


class CorpusError(ValueError):
    """A corpus row that cannot be mapped onto {id, contents}."""


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    contents: str

    def as_dict(self) -> dict:
        return {"id": self.id, "contents": self.contents}


def _row_to_passage(row, where: str, default_id: str) -> Passage:
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object with 'contents' or 'title'+'text', "
                          f"got {type(row).__name__}")
    if "contents" in row:
        contents = row["contents"]
        if not isinstance(contents, str):
            raise CorpusError(f"{where}: field 'contents' must be a string, got {type(contents).__name__}")
    elif "title" in row and "text" in row:
        title, text = row["title"], row["text"]
        if not isinstance(title, str) or not isinstance(text, str):
            raise CorpusError(f"{where}: fields 'title' and 'text' must be strings")
        contents = f'"{title}"\n{text}'
    else:
        raise CorpusError(f"{where}: row has neither 'contents' nor 'title'+'text' "
                          f"(keys: {sorted(row)[:8]})")
    try:
        contents.encode("utf-8")
    except UnicodeEncodeError:
        raise CorpusError(f"{where}: text contains an unpaired surrogate escape (not valid Unicode)") from None
    pid = row.get("id", default_id)
    if isinstance(pid, int) and not isinstance(pid, bool):
        pid = str(pid)
    if not isinstance(pid, str) or not pid:
        raise CorpusError(f"{where}: field 'id' must be a non-empty string, got {pid!r}")
    return Passage(pid, contents)


def _is_json_list(path: str) -> bool:
    with paths.open_file(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def iter_corpus(path: str | os.PathLike) -> Iterator[Passage]:
    """Yield `Passage`s from a jsonl corpus (streamed) or a JSON list file, in file order."""
    path = os.fspath(path)  # a local path or a gs:// URL (read through rexrag_jax.io.paths, streamed)
    if not paths.isfile(path):
        raise FileNotFoundError(f"corpus file not found: {path}")
    if _is_json_list(path):
        with paths.open_file(path, "r", encoding="utf-8") as f:
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(rows, list):
            raise CorpusError(f"{path}:1: expected a JSON list of objects")
        for i, row in enumerate(rows):
            yield _row_to_passage(row, f"{path}: item {i}", str(i))
        return
    with paths.open_file(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise CorpusError(f"{where}: invalid UTF-8 ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
            yield _row_to_passage(row, where, str(lineno - 1))


def read_corpus(path: str | os.PathLike) -> list[Passage]:
    """All passages of a corpus file; raises on duplicate ids (they would make hits ambiguous)."""
    passages, seen = [], set()
    for p in iter_corpus(path):
        if p.id in seen:
            raise CorpusError(f"{os.fspath(path)}: duplicate passage id {p.id!r}")
        seen.add(p.id)
        passages.append(p)
    return passages


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Streaming sha256 of a file's bytes (the corpus checksum recorded in an index manifest); a local path
    or a gs:// URL."""
    h = hashlib.sha256()
    with paths.open_file(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def split_title(contents: str) -> tuple[str, str]:
    """`'"Title"\\ntext'` -> `('Title', 'text')`: first line (outer quotes stripped) and the rest."""
    first, _, rest = contents.partition("\n")
    title = first.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, rest
