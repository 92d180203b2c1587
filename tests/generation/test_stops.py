"""Stop strings: host-side cut on scripted token streams, in-jit sequences, and engine rollback."""
import jax
import numpy as np
import pytest

from rexrag_jax.generation import GenerationEngine, find_stop_cut, stop_token_sequences
from rexrag_jax.generation.sampling import top_p_filter

from .test_engine import CFG, PROMPTS, greedy_reference, params  # noqa: F401  (fixture)

# A scripted vocabulary: "</search>" can be spelled in several token splits.
VOCAB = {0: "", 1: "<search>", 2: " who", 3: " wrote", 4: " it", 5: "</", 6: "search", 7: ">",
         8: " </", 9: ">\n\n", 10: "</search>", 11: "<answer>", 12: " Paris", 13: "</answer>", 14: "x",
         15: "\n", 16: " ", 17: ".", 18: "answer"}


def detok(ids):
    return "".join(VOCAB[i] for i in ids)


STOPS = ("</search>", "</answer>")


def encode(text):
    """Greedy longest-match over VOCAB (a stand-in for a BPE tokenizer)."""
    ids, i = [], 0
    pieces = sorted(((v, k) for k, v in VOCAB.items() if v), key=lambda x: -len(x[0]))
    while i < len(text):
        v, k = next((v, k) for v, k in pieces if text.startswith(v, i))
        ids.append(k)
        i += len(v)
    return ids


@pytest.mark.parametrize("stream, n, text", [
    ([1, 2, 3, 5, 6, 7, 2, 3], 6, "<search> who wrote</search>"),          # split over 3 tokens
    ([1, 2, 8, 6, 9, 14], 5, "<search> who </search>"),                     # completing token has trailing text
    ([1, 2, 10, 11, 12, 13], 3, "<search> who</search>"),                   # single token
    ([11, 12, 13, 1, 2, 10], 3, "<answer> Paris</answer>"),                 # earliest-ending stop wins
    ([1, 2, 5, 6], None, None),                                            # incomplete: no stop
    ([], None, None),
])
def test_find_stop_cut_scripted(stream, n, text):
    got = find_stop_cut(stream, detok, STOPS)
    assert got == (None if n is None else (n, text))


@pytest.mark.parametrize("stream, n, text", [
    ([14, 13, 14, 11, 12, 13, 14], 6, "x</answer>x<answer> Paris</answer>"),   # stray closer: goes on
    ([14, 13, 14, 1, 2, 10, 11, 12, 13], 6, "x</answer>x<search> who</search>"),
    ([14, 10, 11, 12, 13], 5, "x</search><answer> Paris</answer>"),            # stray </search> likewise
    ([1, 2, 11, 12, 13, 10], 5, "<search> who<answer> Paris</answer>"),         # first block to complete
    ([11, 12, 13, 13], 3, "<answer> Paris</answer>"),
    ([14, 13, 14, 13], None, None),                                             # only stray closers
])
def test_find_stop_cut_blocks_takes_first_complete_block(stream, n, text):
    got = find_stop_cut(stream, detok, STOPS, blocks=True)
    assert got == (None if n is None else (n, text))
    if n is None:
        assert find_stop_cut(stream, detok, STOPS, blocks=False) == (2, "x</answer>")  # old rule: stray stops


def test_stop_token_sequences_are_sound_and_cover_spellings():
    seqs = stop_token_sequences(encode, detok, STOPS)
    for seq in seqs:
        assert any(s in detok(list(seq)) for s in STOPS)
    assert (10,) in seqs and (13,) in seqs  # "</search>" and "</answer>" as whole tokens
    assert (8, 6, 7) in seqs  # " </" "search" ">" after a space


def test_top_p_filter_matches_brute_force():
    rng = np.random.RandomState(0)
    z = rng.randn(6, 50).astype(np.float32) * 2
    for top_p in (0.1, 0.5, 0.9, 0.999, 1.0):
        got = np.asarray(top_p_filter(z, np.full(6, top_p, np.float32))) > -1e29
        for b in range(6):
            p = np.exp(z[b] - z[b].max())
            p /= p.sum()
            order = np.argsort(-p)
            before = np.cumsum(p[order]) - p[order]
            want = np.zeros(50, bool)
            want[order[before < top_p]] = True
            want[order[0]] = True
            if top_p >= 1.0:
                want[:] = True
            np.testing.assert_array_equal(got[b], want, err_msg=f"top_p={top_p} row {b}")


def _stop_detok(stream, i, j):
    """Detokenizer under which tokens stream[i], stream[j] spell '</sea' + 'rch>tail' (others: 'a')."""
    table = {stream[i]: "</sea", stream[j]: "rch>tail"}
    return lambda ids: "".join(table.get(t, "a") for t in ids)


@pytest.mark.parametrize("in_jit", [False, True])
def test_engine_cuts_at_stop_string_and_rolls_back(params, in_jit):  # noqa: F811
    ref = greedy_reference(params, PROMPTS[0], 24)
    # pick two consecutive positions whose ids occur nowhere earlier in the stream
    i = next(i for i in range(2, 20) if ref[i] not in ref[:i] and ref[i + 1] not in ref[: i + 1]
             and ref[i] != ref[i + 1])
    detokenize = _stop_detok(ref, i, i + 1)
    seqs = ((ref[i], ref[i + 1]),) if in_jit else ()
    eng = GenerationEngine(params, CFG, 4, 128, decode_chunk=16, detokenize=detokenize,
                           stop_strings=("</search>",), stop_token_seqs=seqs, stop_blocks=False)
    eng.append([0, 1], PROMPTS[:2])
    a, b = eng.generate([0, 1], 24, jax.random.PRNGKey(0), greedy=True)
    assert a.stop_reason == "stop"
    assert a.tokens == ref[: i + 2] and len(a.logprobs) == i + 2
    assert a.text == "a" * i + "</search>"
    assert eng.lengths()[0] == len(PROMPTS[0]) + i + 2
    # row 1 is unaffected unless its own stream happens to spell the stop string
    ref_b = greedy_reference(params, PROMPTS[1], 24)
    if find_stop_cut(ref_b, detokenize, ("</search>",), blocks=False) is None:
        assert b.tokens == ref_b and b.stop_reason == "length"
    # after the cut, the row continues exactly as a fresh prefill of prompt + cut tokens would
    obs = [3, 4, 5]
    eng.append([0], [obs])
    cont = eng.generate([0], 6, jax.random.PRNGKey(0), greedy=True)[0]
    assert cont.tokens == greedy_reference(params, PROMPTS[0] + ref[: i + 2] + obs, 6)


@pytest.mark.parametrize("in_jit", [False, True])
def test_engine_decodes_past_a_stray_closer_to_the_first_complete_block(params, in_jit):  # noqa: F811
    """stop_blocks (default): a `</answer>` with no `<answer>` before it is not a stop, even when the
    device stops on its token sequence; the row resumes and stops at the block's closer."""
    ref = greedy_reference(params, PROMPTS[0], 32)
    pos = []
    for p in range(1, 30):
        if ref[p] not in ref[:p] and ref[p] not in [ref[q] for q in pos] and (not pos or p > pos[-1] + 1):
            pos.append(p)
        if len(pos) == 3:
            break
    i, j, k = pos
    table = {ref[i]: "</answer>", ref[j]: "<answer>", ref[k]: "</answer>"}
    detokenize = lambda ids: "".join(table.get(t, "a") for t in ids)  # noqa: E731
    seqs = ((ref[i],), (ref[k],)) if in_jit else ()
    eng = GenerationEngine(params, CFG, 4, 128, decode_chunk=4, detokenize=detokenize,
                           stop_strings=STOPS, stop_token_seqs=seqs)
    eng.append([0], PROMPTS[:1])
    a = eng.generate([0], 32, jax.random.PRNGKey(0), greedy=True)[0]
    assert a.stop_reason == "stop" and a.tokens == ref[: k + 1]
    assert a.text == "a" * i + "</answer>" + "a" * (j - i - 1) + "<answer>" + "a" * (k - j - 1) + "</answer>"
    assert eng.lengths()[0] == len(PROMPTS[0]) + k + 1
    # the old rule stops at the stray closer
    eng = GenerationEngine(params, CFG, 4, 128, decode_chunk=4, detokenize=detokenize,
                           stop_strings=STOPS, stop_token_seqs=seqs, stop_blocks=False)
    eng.append([0], PROMPTS[:1])
    b = eng.generate([0], 32, jax.random.PRNGKey(0), greedy=True)[0]
    assert b.tokens == ref[: i + 1] and b.text == "a" * i + "</answer>"
