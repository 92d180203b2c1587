"""Shared stand-ins for the RAPO tests: a bag-of-words hashing encoder (unit vectors), and the rollout
tests' scripted engine / toy tokenizer / fake retriever (imported from tests/rollout, read-only)."""
import pathlib
import re
import sys
import zlib

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "rollout"))
from rollout_fakes import FakeRetriever, ScriptedEngine, ToyTokenizer, fake_logprob  # noqa: E402,F401

DIM = 1024


def bow_encode(texts):
    """Unit-norm hashed bag of words: texts sharing more words are nearer (a deterministic MiniLM stand-in)."""
    out = np.zeros((len(texts), DIM), np.float32)
    for i, t in enumerate(texts):
        for w in re.findall(r"\w+", t.lower()):
            out[i, zlib.crc32(w.encode()) % DIM] += 1.0
        out[i] /= max(np.linalg.norm(out[i]), 1e-6)
    return out
