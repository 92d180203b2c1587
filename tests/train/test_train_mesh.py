"""The trainer under a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices matches the unsharded run."""
import pytest

from rexrag_jax.train.metrics_log import read_metrics
from test_train_reliability import _run  # noqa: E402  (same folder; pytest puts it on sys.path)

BINDINGS = ("TOTAL_STEPS = 2", "TrainConfig.initial_keep_ratio = 0.0")  # no probes: K would round to dp anyway


def test_sharded_training_matches_single_device(tmp_path):
    _run(tmp_path / "single", *BINDINGS)
    _run(tmp_path / "mesh", *BINDINGS, "MESH_SHAPE = (2, 2, 2)")
    single, mesh = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "mesh")
    assert sorted(single) == sorted(mesh) == [1, 2]
    for step in (1, 2):  # step 2's inputs depend on step 1's sharded update
        for key in ("loss", "grad_norm", "all/ratio_mean", "all/clip_frac", "kl", "entropy", "reward/mean"):
            assert float(mesh[step][key]) == pytest.approx(float(single[step][key]), rel=2e-4, abs=1e-6), (step, key)
    assert (tmp_path / "mesh" / "checkpoints" / "2").is_dir()
