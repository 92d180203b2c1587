"""The packed trainer compiles during its first steps only, though trajectory lengths and kept rows vary."""
import jax
import numpy as np

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.train import compile_watch
from rexrag_jax.train.synthetic import SyntheticRollout, synthetic_examples
from rexrag_jax.train.trainer import TrainConfig, Trainer


def test_no_compilation_after_step_3(tmp_path):
    compile_watch.install()
    # 2 questions x 4 originals + up to 8 probes: N <= 16 (one ROW_BUCKET of the RL math), one mini-batch
    cfg = TrainConfig(total_steps=6, num_questions=2, group_size=4, mini_batch=16, micro_batch=4, kl_coef=0.001,
                      length_bucket=16, max_seq_len=64, pack_sequences=True, pack_length=64, pack_rows=2,
                      initial_keep_ratio=1.0)
    trainer = Trainer(str(tmp_path), model_cfg=Qwen2Config.from_preset("tiny"),
                      rollout=SyntheticRollout(vocab_size=256, probe_prob=0.7, correct_prob=0.3), config=cfg,
                      train_examples=synthetic_examples(12), use_tensorboard=False)
    counts, lengths, rows = [], set(), set()
    for _ in range(6):
        m = trainer.train_step()
        counts.append(compile_watch.compilations())
        lengths.add(m["response_len/max"])
        rows.add(m["batch/trajectories"])
    trainer.ckpt.close()
    assert len(lengths) > 1 and len(rows) > 1  # the steps really differ in lengths and kept rows
    assert counts[0] > 0
    assert counts[3:] == [counts[2]] * 3, f"compilations after each step: {counts}"
    # the counter does see a new program (here: a shape no step used)
    jax.jit(lambda x: x * 2 + 1)(np.zeros(37, np.float32)).block_until_ready()
    assert compile_watch.compilations() > counts[-1]
