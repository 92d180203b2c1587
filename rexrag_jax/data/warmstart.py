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
"response" (model tokens, in the loss), "information" (observation, masked out), "context" (model text
that is conditioned on but not learnt) or "probe" (an inserted revision prompt, masked out).

A "revision" trajectory (fraction `revision_fraction`, drawn from the non-dead-end questions) is the
pretrained-LLM prior REX-RAG relies on (SPEC §3): a dead end cut exactly where a probe cuts it (the
`<answer>` block removed), one prompt of the revision pool, then the correct continuation:

    [context]  <think> I need the founder of Zelko. </think><search> Zelko founder </search>
    [information] ...
    [context]  <think> The founder of Zelko is Marvo. </think>
    [probe]    <think> Perhaps I've overlooked critical points or slipped up in my logic.
    [response]  The founder of Zelko is Marvo. I need the birthplace of Marvo. </think><search> Marvo birthplace </search>
    [information] ...
    [response] <think> The birthplace of Marvo is Tavik. </think><answer> Tavik </answer>

Only the continuation is in the loss: the prefix is a dead end (learning it would add dead ends) and
the prompt is not the model's (learning it would teach the policy to reflect on its own, which the
paper's base model rarely does). So the warm start learns "after a revision prompt, search on" and
nothing else from these records.

Where dead ends happen ("random" vs "trap" dead ends). Random dead ends (`dead_end_fraction`: a share
of the records stops after j ~ U{0..k-1} searches) spread the early-answer decision thinly over every
context: the greedy warm start then almost never answers early (searching on is the majority at every
step), so its held-out errors are copy errors that no revision prompt can fix, and probes lose to
fresh samples (issue 12: probe 1.1-2.2 % vs fresh 1.8-4.8 % over 3 worlds). Trap dead ends
(`trap_relations`) make the dead end a habit, as in an LLM that stops at the intermediate entity: at
every hop j >= 1 whose relation is a trap relation, the record answers with the entity found so far
with probability `trap_dead_end_prob` (the first trap that fires ends it). So the greedy policy answers
too early on every question with a trap relation after its first hop (~30 % of questions), sampling
rarely escapes, and a share `trap_revision_share` of the fired traps become revision records cut at
exactly that point. The prior the probes rely on is then present (after a revision prompt, search on)
and the dead ends are real (without one, answer).
"""
from __future__ import annotations

import random

from rexrag_jax.data.prompts import build_prompt_text
from rexrag_jax.data.synthetic_world import World, WorldRetriever

RESPONSE, INFORMATION, CONTEXT, PROBE = "response", "information", "context", "probe"
SEGMENT_KINDS = (RESPONSE, INFORMATION, CONTEXT, PROBE)  # only RESPONSE is in the SFT loss


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
REVISION_CONTINUATIONS = ("restate", "research")


def _search_turns(hops, known, retriever, topk, kind):
    """(segments, last known fact) of one search turn per hop: think (+ the last fact) + search + observation."""
    segments = []
    for subj, rel, obj in hops:
        lead = f"The {known[1]} of {known[0]} is {known[2]}. " if known else ""
        query = f"{subj} {rel}"
        segments.append([kind, f"<think> {lead}I need the {rel} of {subj}. </think><search> {query} </search>"])
        segments.append([INFORMATION, observation(retriever.search([query], topk)[0])])
        known = (subj, rel, obj)
    return segments, known


def pick_trap_relations(seed: int, n: int) -> tuple[str, ...]:
    """n relation names drawn from the world's relations by `seed` (sorted): the demo's trap relations."""
    from rexrag_jax.data.synthetic_world import RELATIONS

    if not 0 <= n <= len(RELATIONS):
        raise ValueError(f"number of trap relations must be in [0, {len(RELATIONS)}], got {n}")
    return tuple(sorted(random.Random(f"trap-relations-{seed}").sample(sorted(RELATIONS), n)))


def trap_stop(world: World, example, trap_relations, dead_end_prob: float, rng: random.Random) -> int | None:
    """Searches done before a trap dead end answers (the first hop j >= 1 whose relation is a trap and
    whose draw fires, probability dead_end_prob each), or None when no trap fires."""
    hops = world.hops(example.id)
    for j in range(1, len(hops)):
        if hops[j][1] in trap_relations and rng.random() < dead_end_prob:
            return j
    return None


def has_trap(world: World, example, trap_relations) -> bool:
    """Whether a question's chain has a trap relation after its first hop (the greedy warm start's dead ends)."""
    return any(r in trap_relations for _, r, _ in world.hops(example.id)[1:])


def make_trajectory(world: World, example, retriever, *, dead_end: bool, rng: random.Random,
                    topk: int = 3, dead_end_stop: str = "any_hop", revision_prompt: str | None = None,
                    stop: int | None = None, learn_prompt: bool = False, continuation: str = "restate") -> dict:
    """One trajectory record (see the module docstring); `retriever` has `search(queries, topk)`.

    dead_end_stop: where a dead end stops, "any_hop" (after j ~ U{0..k-1} searches) or "no_search"
    (always guesses before the first search, so the early-answer decision is the first one).
    revision_prompt: make a revision trajectory (dead end, this prompt, correct continuation; not with
    dead_end=True). stop: searches before the dead end answers (a trap dead end), instead of drawing it.
    learn_prompt: a self-reflection record: the revision prompt is the model's own text (a "response"
    segment, in the SFT loss) instead of an inserted one (a "probe" segment, masked out).
    continuation: what a revision record does after the prompt (REVISION_CONTINUATIONS): "restate" the last
    fact and search the next hop, or "research": re-issue the last query ("Let me search again."), then walk
    on from the repeated observation exactly as a correct record does (no searches done: as "restate")."""
    if continuation not in REVISION_CONTINUATIONS:
        raise ValueError(f"revision continuation must be one of {REVISION_CONTINUATIONS}, got {continuation!r}")
    if dead_end_stop not in DEAD_END_STOPS:
        raise ValueError(f"dead_end_stop must be one of {DEAD_END_STOPS}, got {dead_end_stop!r}")
    if dead_end and revision_prompt is not None:
        raise ValueError("make_trajectory: a trajectory is a dead end or a revision, not both")
    hops = world.hops(example.id)
    k = len(hops)
    if stop is not None:
        if not (dead_end or revision_prompt is not None) or not 0 <= stop < k:
            raise ValueError(f"make_trajectory: stop={stop} needs a dead end or revision and 0 <= stop < {k}")
    elif dead_end or revision_prompt is not None:
        stop = rng.randrange(k) if dead_end_stop == "any_hop" else 0  # searches done before answering
    else:
        stop = k
    prefix_kind = CONTEXT if revision_prompt is not None else RESPONSE
    segments, known = _search_turns(hops[:stop], None, retriever, topk, prefix_kind)
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
    if revision_prompt is not None:
        # the probe's cut: the dead end's think kept, its <answer> block replaced by the prompt
        segments.append([CONTEXT, f"<think> {think} </think>"])
        segments.append([RESPONSE if learn_prompt else PROBE, revision_prompt])
        if continuation == "research" and known is not None:
            # re-issue the last query verbatim, then walk on from its (repeated) observation as a normal
            # step does: the next entity is copied from right after the observation, the skill the warm
            # start is best at, instead of across the prompt (issue 12, fourth pass)
            last = f"{known[0]} {known[1]}"
            segments.append([RESPONSE, f" Let me search again. </think><search> {last} </search>"])
            segments.append([INFORMATION, observation(retriever.search([last], topk)[0])])
            rest, known = _search_turns(hops[stop:], known, retriever, topk, RESPONSE)
            segments += rest
        else:
            subj, rel, obj = hops[stop]
            query = f"{subj} {rel}"
            # the continuation restates the last fact before the next hop: the entity to search next is then
            # copied from right beside it, not from before the prompt (a 2-layer warm start copying across the
            # prompt names a wrong entity in most probes: probe 5.9% vs fresh 4.5%)
            restate = f" {think}" if known is not None else ""
            segments.append([RESPONSE, f"{restate} I need the {rel} of {subj}. </think><search> {query} </search>"])
            segments.append([INFORMATION, observation(retriever.search([query], topk)[0])])
            rest, known = _search_turns(hops[stop + 1:], (subj, rel, obj), retriever, topk, RESPONSE)
            segments += rest
        answer = known[2]
        think = f"The {known[1]} of {known[0]} is {known[2]}."
    segments.append([RESPONSE, f"<think> {think} </think><answer> {answer} </answer>"])
    if dead_end and answer in example.golden_answers:  # guaranteed by the world's no-loop chains
        raise AssertionError(f"dead end for {example.id} answered correctly")
    return {"id": example.id, "question": example.question, "golden_answers": list(example.golden_answers),
            "data_source": example.data_source, "prompt_text": build_prompt_text(example.question),
            "response": "".join(t for _, t in segments), "segments": segments,
            "num_searches": sum(kind == INFORMATION for kind, _ in segments), "dead_end": dead_end,
            "revision": revision_prompt is not None, "stop": stop if stop < k else None,
            "self_reflection": bool(learn_prompt and revision_prompt is not None)}


def make_warmstart(world: World, *, dead_end_fraction: float = 0.2, seed: int = 0, retriever=None,
                   topk: int = 3, examples=None, dead_end_stop: str = "any_hop", revision_fraction: float = 0.0,
                   revision_prompts=None, trap_relations=(), trap_dead_end_prob: float = 0.85,
                   trap_revision_share: float = 0.3, trap_reflect_share: float = 0.0,
                   revision_continuation: str = "restate") -> list[dict]:
    """Trajectories for `examples` (default: the train split), deterministic given `seed`.

    Exactly round(dead_end_fraction * n) of them are dead ends and round(revision_fraction * n) others
    are revision trajectories (both chosen at random; the rest are correct). A revision trajectory's
    prompt is drawn uniformly from `revision_prompts` (default: the gin-configured pool,
    rexrag_jax.rl.prompt_pool.revision_prompts()). `retriever` defaults to `WorldRetriever` over the
    world's corpus; pass the run's retriever so that the observations match what the policy will see.

    trap_relations (non-empty: trap dead ends, module docstring): every record not chosen as a random
    dead end or revision walks its hops; a trap that fires (trap_dead_end_prob) makes it a dead end at
    that hop, or with probability trap_revision_share a revision record cut there. A share
    trap_reflect_share of those revision records are self-reflection records: the prompt is in the loss,
    so the warm start reflects on its own after a trap with a small probability (the base LLM's rare
    self-reflection, which the probes' prompt tokens then reinforce).
    """
    from rexrag_jax.data.synthetic_world import RELATIONS

    unknown = [r for r in trap_relations if r not in RELATIONS]
    if unknown:
        raise ValueError(f"trap_relations: unknown relation(s) {unknown} (expected some of {sorted(RELATIONS)})")
    for name, v in (("dead_end_fraction", dead_end_fraction), ("revision_fraction", revision_fraction),
                    ("trap_dead_end_prob", trap_dead_end_prob), ("trap_revision_share", trap_revision_share),
                    ("trap_reflect_share", trap_reflect_share)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    if dead_end_fraction + revision_fraction > 1.0:
        raise ValueError(f"dead_end_fraction + revision_fraction = {dead_end_fraction + revision_fraction} > 1")
    examples = world.train if examples is None else examples
    retriever = retriever or WorldRetriever(world.corpus_rows())
    rng = random.Random(seed)
    n_dead = round(dead_end_fraction * len(examples))
    dead = set(rng.sample(range(len(examples)), n_dead))
    revision = set()
    if revision_prompts is None and (revision_fraction > 0 or trap_relations):
        from rexrag_jax.rl.prompt_pool import revision_prompts as pool
        revision_prompts = pool()
    if revision_fraction > 0:
        rest = [i for i in range(len(examples)) if i not in dead]
        revision = set(rng.sample(rest, min(len(rest), round(revision_fraction * len(examples)))))
    out = []
    for i, ex in enumerate(examples):
        stop, learn = None, False
        dead_end, prompt = i in dead, rng.choice(list(revision_prompts)) if i in revision else None
        if trap_relations and not dead_end and prompt is None:
            stop = trap_stop(world, ex, trap_relations, trap_dead_end_prob, rng)
            if stop is not None:
                if rng.random() < trap_revision_share:
                    prompt = rng.choice(list(revision_prompts))
                    learn = trap_reflect_share > 0 and rng.random() < trap_reflect_share
                else:
                    dead_end = True
        out.append(make_trajectory(world, ex, retriever, dead_end=dead_end, rng=rng, topk=topk,
                                   dead_end_stop=dead_end_stop, revision_prompt=prompt, stop=stop,
                                   learn_prompt=learn, continuation=revision_continuation))
    return out


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
