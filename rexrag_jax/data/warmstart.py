"""Supervised warm-start trajectories for the synthetic world, in the exact rollout format (SPEC §1).

A correct k-hop trajectory (one search per hop, observation appended by the environment):

    <think> I need the founder of Zelko. </think><search> Zelko founder </search>
    \\n\\n<information>Doc 1(Title: "Zelko") Zelko is a company. ...\\n...</information>\\n\\n
    <think> The founder of Zelko is Marvo. I need the birthplace of Marvo. </think><search> Marvo birthplace </search>
    \\n\\n<information>...</information>\\n\\n
    <think> The birthplace of Marvo is Tavik. </think><answer> Tavik </answer>

A "dead end" (fraction `dead_end_fraction`) stops after j < k searches (j random, or j = 0 with
dead_end_stop="no_search") and answers wrongly: with the
entity found so far (j >= 1: "<think> The founder of Zelko is Marvo. </think><answer> Marvo </answer>")
or, with no search at all, a random entity of the answer's type. The answer is never a gold answer,
so RL and probes have something to fix. Each record keeps `segments` [[kind, text], ...] with kind
"response" (model tokens, in the loss) or "information" (observation, masked out).
"""
from __future__ import annotations

import random

from rexrag_jax.data.prompts import build_prompt_text
from rexrag_jax.data.synthetic_world import World, WorldRetriever

RESPONSE, INFORMATION = "response", "information"


def _format_passages(hits) -> str:
    try:  # owned by retrieval (SPEC §1 observation format)
        from rexrag_jax.retrieval.format import format_passages
    except ImportError:  # private equivalent, same format: Doc {k}(Title: {first line}) {rest}\n
        def format_passages(hits):
            out = []
            for k, hit in enumerate(hits, start=1):
                title, _, text = (hit["document"] if "document" in hit else hit)["contents"].partition("\n")
                out.append(f"Doc {k}(Title: {title}) {text}\n")
            return "".join(out)
    return format_passages(hits)


def observation(hits) -> str:
    """`\\n\\n<information>{passages}</information>\\n\\n` as appended after a search (SPEC §1)."""
    return f"\n\n<information>{_format_passages(hits)}</information>\n\n"


DEAD_END_STOPS = ("any_hop", "no_search")


def make_trajectory(world: World, example, retriever, *, dead_end: bool, rng: random.Random,
                    topk: int = 3, dead_end_stop: str = "any_hop") -> dict:
    """One trajectory record (see the module docstring); `retriever` has `search(queries, topk)`.

    dead_end_stop: where a dead end stops, "any_hop" (after j ~ U{0..k-1} searches) or "no_search"
    (always guesses before the first search, so the early-answer decision is the first one)."""
    if dead_end_stop not in DEAD_END_STOPS:
        raise ValueError(f"dead_end_stop must be one of {DEAD_END_STOPS}, got {dead_end_stop!r}")
    hops = world.hops(example.id)
    k = len(hops)
    if dead_end:
        stop = rng.randrange(k) if dead_end_stop == "any_hop" else 0  # searches done before answering
    else:
        stop = k
    segments: list[list[str]] = []
    known = None  # (subject, relation, object) learnt from the last observation
    for subj, rel, _ in hops[:stop]:
        lead = f"The {known[1]} of {known[0]} is {known[2]}. " if known else ""
        query = f"{subj} {rel}"
        segments.append([RESPONSE, f"<think> {lead}I need the {rel} of {subj}. </think><search> {query} </search>"])
        segments.append([INFORMATION, observation(retriever.search([query], topk)[0])])
        known = hops[len(segments) // 2 - 1]
    if known is not None:
        answer = known[2]
        think = f"The {known[1]} of {known[0]} is {known[2]}."
    else:  # guess without searching: a random entity of the answer's type
        head_id, rels = world.chains[example.id]
        gold_id = world.names.index(example.golden_answers[0])
        candidates = [e for e, t in enumerate(world.types) if t == world.types[gold_id] and e != gold_id
                      and e != head_id]
        answer = world.names[rng.choice(candidates)]
        think = f"I think the answer is {answer}."
    segments.append([RESPONSE, f"<think> {think} </think><answer> {answer} </answer>"])
    if dead_end and answer in example.golden_answers:  # guaranteed by the world's no-loop chains
        raise AssertionError(f"dead end for {example.id} answered correctly")
    return {"id": example.id, "question": example.question, "golden_answers": list(example.golden_answers),
            "data_source": example.data_source, "prompt_text": build_prompt_text(example.question),
            "response": "".join(t for _, t in segments), "segments": segments, "num_searches": stop,
            "dead_end": dead_end}


def make_warmstart(world: World, *, dead_end_fraction: float = 0.2, seed: int = 0, retriever=None,
                   topk: int = 3, examples=None, dead_end_stop: str = "any_hop") -> list[dict]:
    """Trajectories for `examples` (default: the train split), deterministic given `seed`.

    Exactly round(dead_end_fraction * n) of them are dead ends (chosen at random). `retriever` defaults
    to `WorldRetriever` over the world's corpus; pass the run's retriever so that the observations
    match what the policy will see (the think/answer text follows the world's facts either way).
    """
    if not 0.0 <= dead_end_fraction <= 1.0:
        raise ValueError(f"dead_end_fraction must be in [0, 1], got {dead_end_fraction}")
    examples = world.train if examples is None else examples
    retriever = retriever or WorldRetriever(world.corpus_rows())
    rng = random.Random(seed)
    n_dead = round(dead_end_fraction * len(examples))
    dead = set(rng.sample(range(len(examples)), n_dead))
    return [make_trajectory(world, ex, retriever, dead_end=i in dead, rng=rng, topk=topk, dead_end_stop=dead_end_stop)
            for i, ex in enumerate(examples)]


def training_text(world: World, trajectories: list[dict]) -> list[str]:
    """Lines to train a small SentencePiece model on: passages, prompts, questions and trajectories."""
    lines = [r["contents"] for r in world.corpus_rows()]
    lines += [build_prompt_text(e.question) for e in world.train + world.test]
    lines += [t["response"] for t in trajectories]
    return lines


def oracle_generate_fn(world: World, retriever=None, topk: int = 3):
    """generate_fn(list[QAExample]) -> responses of the perfect searcher (upper bound; eval sanity check)."""
    retriever = retriever or WorldRetriever(world.corpus_rows())
    rng = random.Random(0)  # unused by correct trajectories; make_trajectory needs one

    def generate_fn(examples):
        return [make_trajectory(world, ex, retriever, dead_end=False, rng=rng, topk=topk)["response"]
                for ex in examples]
    return generate_fn
