"""A small fictional knowledge world for the embedded demo: corpus + 1/2/3-hop questions.

Made-up names (so no model can know an answer without searching), few relation types, one passage per
entity listing its relations in fixed phrasing, and questions whose answer needs one search per hop:

    passage   {"id": "17", "contents": "\"Zelko\"\nZelko is a company. The founder of Zelko is Marvo. ..."}
    question  "What is the birthplace of the founder of Zelko?"  golden_answers ["Tavik"], data_source synth_2hop
    searches  "Zelko founder" -> Marvo ; "Marvo birthplace" -> Tavik       (entity name + relation)

Names are consonant-vowel syllables (e.g. "Tavi", "Moruk"), pairwise at edit distance >= 2, so a tiny
SentencePiece vocabulary covers the whole world. Train and test questions start from disjoint head
entities. Everything is a deterministic function of `WorldConfig` (seeded `random.Random`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import tempfile

import numpy as np

from rexrag_jax.data.schema import QAExample

ENTITY_TYPES = ("person", "city", "country", "company")
# relation -> (subject type, object type); phrased "The {relation} of {subject} is {object}."
RELATIONS = {
    "birthplace": ("person", "city"),
    "employer": ("person", "company"),
    "mentor": ("person", "person"),
    "country": ("city", "country"),
    "mayor": ("city", "person"),
    "capital": ("country", "city"),
    "leader": ("country", "person"),
    "founder": ("company", "person"),
    "headquarters": ("company", "city"),
}
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_FINALS = "nrskl"


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    num_person: int = 120
    num_city: int = 40
    num_country: int = 10
    num_company: int = 30
    test_head_fraction: float = 0.2            # share of entities whose questions go to the test split
    train_per_hop: tuple[int, int, int] = (1000, 1000, 1000)   # questions for 1, 2, 3 hops (capped)
    test_per_hop: tuple[int, int, int] = (100, 100, 100)
    # facts (and then the questions) drawn from their own seed: a "reading world" with this world's names
    # and types but other facts (the demo's warm start reads these so that memorising facts cannot help)
    fact_seed: int | None = None


@dataclasses.dataclass
class World:
    config: WorldConfig
    names: list[str]                     # entity id -> name
    types: list[str]                     # entity id -> type
    facts: dict[tuple[int, str], int]    # (subject id, relation) -> object id
    train: list[QAExample]
    test: list[QAExample]
    chains: dict[str, tuple[int, tuple[str, ...]]]  # question id -> (head entity id, relations)

    def corpus_rows(self) -> list[dict]:
        """Search-R1 corpus rows, one per entity: {"id": str(entity id), "contents": '"Name"\\ntext'}."""
        return [{"id": str(e), "contents": f'"{self.names[e]}"\n{self.passage_text(e)}'} for e in range(len(self.names))]

    def passage_text(self, e: int) -> str:
        name = self.names[e]
        facts = [f"The {r} of {name} is {self.names[self.facts[(e, r)]]}."
                 for r, (subj, _) in RELATIONS.items() if subj == self.types[e]]
        return f"{name} is a {self.types[e]}. " + " ".join(facts)

    def hops(self, qid: str) -> list[tuple[str, str, str]]:
        """(subject name, relation, object name) per hop of a question, in search order."""
        e, rels = self.chains[qid]
        out = []
        for r in rels:
            nxt = self.facts[(e, r)]
            out.append((self.names[e], r, self.names[nxt]))
            e = nxt
        return out


def _deletions(name: str) -> set[str]:
    return {name} | {name[:i] + name[i + 1:] for i in range(len(name))}


def make_names(n: int, rng: random.Random, reserved=()) -> list[str]:
    """n capitalised CVCV(+C) names with pairwise edit distance >= 2.

    Two strings are within edit distance 1 iff their one-deletion neighbourhoods intersect, so a
    candidate is rejected when any of its neighbours is already taken.
    """
    taken: set[str] = set()
    for word in reserved:
        taken |= _deletions(word.lower())
    names = []
    for _ in range(200 * n):
        if len(names) == n:
            return names
        s = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2))
        if rng.random() < 0.5:
            s += rng.choice(_FINALS)
        nb = _deletions(s)
        if nb & taken:
            continue
        taken |= nb
        names.append(s.capitalize())
    raise ValueError(f"could not draw {n} distinct names; lower the entity counts")


def _chains(max_hops: int) -> dict[str, list[tuple[str, ...]]]:
    """All relation sequences of 1..max_hops hops per head type, with matching types."""
    out = {t: [] for t in ENTITY_TYPES}
    frontier = [(t, (), t) for t in ENTITY_TYPES]
    for _ in range(max_hops):
        nxt = []
        for head, rels, cur in frontier:
            for r, (subj, obj) in RELATIONS.items():
                if subj == cur:
                    out[head].append(rels + (r,))
                    nxt.append((head, rels + (r,), obj))
        frontier = nxt
    return out


def question_text(head_name: str, rels: tuple[str, ...]) -> str:
    """"Who/What is the r_h of ... the r_1 of Head?" (Who when the answer is a person)."""
    phrase = head_name
    for r in rels:
        phrase = f"the {r} of {phrase}"
    wh = "Who" if RELATIONS[rels[-1]][1] == "person" else "What"
    return f"{wh} is {phrase}?"


def _assign_facts(types: list[str], rng: random.Random) -> dict[tuple[int, str], int]:
    by_type = {t: [e for e, ty in enumerate(types) if ty == t] for t in ENTITY_TYPES}
    facts: dict[tuple[int, str], int] = {}
    countries, cities = by_type["country"], by_type["city"]
    for i, c in enumerate(cities):  # every country gets a city first, so each has a capital
        facts[(c, "country")] = countries[i] if i < len(countries) else rng.choice(countries)
    for k in countries:
        facts[(k, "capital")] = rng.choice([c for c in cities if facts[(c, "country")] == k])
    for e, t in enumerate(types):
        for r, (subj, obj) in RELATIONS.items():
            if subj == t and (e, r) not in facts:
                facts[(e, r)] = rng.choice([o for o in by_type[obj] if o != e])
    return facts


def _questions(names, types, facts, heads, per_hop, split, rng, chains):
    out, meta = [], {}
    for h, n in enumerate(per_hop, start=1):
        pool = []
        for e in heads:
            for rels in chains[types[e]]:
                if len(rels) != h:
                    continue
                path, cur = [e], e
                for r in rels:
                    cur = facts[(cur, r)]
                    path.append(cur)
                # No loops (the answer is never an entity seen earlier), and the answer is not named in
                # any passage before the last hop's, so every hop needs its own search.
                early = {facts[(p, r)] for p in path[:-2] for r, (subj, _) in RELATIONS.items() if subj == types[p]}
                if len(set(path)) == len(path) and path[-1] not in early:
                    pool.append((e, rels))
        rng.shuffle(pool)
        for i, (e, rels) in enumerate(pool[:n]):
            qid = f"synth_{h}hop_{split}_{i}"
            answer = e
            for r in rels:
                answer = facts[(answer, r)]
            out.append(QAExample(qid, question_text(names[e], rels), [names[answer]], f"synth_{h}hop"))
            meta[qid] = (e, rels)
    return out, meta


def generate_world(config: WorldConfig = WorldConfig()) -> World:
    """The world, its corpus and its train/test questions, deterministically from `config`."""
    if config.num_city < config.num_country:
        raise ValueError("num_city must be >= num_country (every country needs a capital)")
    rng = random.Random(config.seed)
    counts = [config.num_person, config.num_city, config.num_country, config.num_company]
    types = [t for t, n in zip(ENTITY_TYPES, counts) for _ in range(n)]
    reserved = set(RELATIONS) | set(ENTITY_TYPES) | {"the", "of", "is", "who", "what", "need", "find"}
    names = make_names(len(types), rng, reserved)
    facts = _assign_facts(types, rng if config.fact_seed is None else random.Random(f"facts-{config.fact_seed}"))
    order = list(range(len(types)))
    rng.shuffle(order)
    n_test = round(config.test_head_fraction * len(order))
    test_heads, train_heads = sorted(order[:n_test]), sorted(order[n_test:])
    chains = _chains(3)
    train, meta_train = _questions(names, types, facts, train_heads, config.train_per_hop, "train", rng, chains)
    test, meta_test = _questions(names, types, facts, test_heads, config.test_per_hop, "test", rng, chains)
    return World(config, names, types, facts, train, test, {**meta_train, **meta_test})


_WORD = re.compile(r"[a-z0-9]+")


class WorldRetriever:
    """Exact lexical retriever over a corpus (the `Retriever.search` interface), for tests and warm start.

    score(query, passage) = 3 * [the title is a query word] + |query words & passage words|;
    ties broken by corpus order. With "Name relation" queries the named entity's passage ranks first.
    """

    def __init__(self, corpus_rows: list[dict]):
        self.rows = corpus_rows
        titles = [r["contents"].split("\n", 1)[0].strip('"').lower() for r in corpus_rows]
        words = [set(_WORD.findall(r["contents"].lower())) for r in corpus_rows]
        self.vocab = {w: i for i, w in enumerate(sorted(set().union(*words)))} if words else {}
        # score = M @ q with M[p, w] = [w in passage p] + 3 [w is p's title]
        self.matrix = np.zeros((len(corpus_rows), len(self.vocab)), np.float32)
        for p, (title, ws) in enumerate(zip(titles, words)):
            self.matrix[p, [self.vocab[w] for w in ws]] = 1.0
            if title in self.vocab:
                self.matrix[p, self.vocab[title]] += 3.0

    def search(self, queries, topk: int = 3) -> list[list[dict]]:
        q = np.zeros((len(queries), len(self.vocab)), np.float32)
        for i, text in enumerate(queries):
            q[i, [self.vocab[w] for w in set(_WORD.findall(text.lower())) if w in self.vocab]] = 1.0
        scores = q @ self.matrix.T
        out = []
        for row in scores:
            best = np.argsort(-row, kind="stable")[:topk]  # stable: ties keep corpus order
            out.append([{"document": dict(self.rows[i]), "score": float(row[i])} for i in best])
        return out


def _write_jsonl(path: str, rows) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_world(world: World, out_dir, trajectories: list[dict] | None = None) -> dict[str, str]:
    """corpus.jsonl, train.jsonl, test.jsonl (+ warmstart.jsonl) under out_dir; returns the paths.

    QA files are named so that `read_qa_file` keeps the per-row data_source (synth_1hop, ...).
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{k}.jsonl") for k in ("corpus", "train", "test")}
    _write_jsonl(paths["corpus"], world.corpus_rows())
    _write_jsonl(paths["train"], (e.to_dict() for e in world.train))
    _write_jsonl(paths["test"], (e.to_dict() for e in world.test))
    if trajectories is not None:
        paths["warmstart"] = os.path.join(out_dir, "warmstart.jsonl")
        _write_jsonl(paths["warmstart"], trajectories)
    return paths
