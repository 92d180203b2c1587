"""benchmarks/replication.py --quick: the plumbing of the three-arm replication (not the effect).

One tiny world, the three arms (GRPO, REX-RAG without the correction, REX-RAG), the JSON shape, the
printed intervals, resume at the arm a killed run was on, and the bad-input refusals.
"""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("replication", os.path.join(ROOT, "benchmarks", "replication.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


replication = _load()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rep") / "run")
    out = root + ".json"
    rc = replication.main(["--quick", "--seeds", "0", "--run_root", root, "--json_out", out])
    return rc, root, out


def test_quick_replication_writes_the_json_shape(quick, capsys):
    rc, root, out = quick
    assert rc == 0
    res = json.load(open(out))
    assert res == json.load(open(os.path.join(root, "results.json")))
    assert res["command"].startswith("python benchmarks/replication.py") and res["commit"]
    assert res["wall_seconds"] > 0
    # --quick keeps the quick sizes; the full run's settings (1,600 SFT steps, 4 reading worlds) do not leak in
    for k in ("sft_steps", "reading_worlds"):
        assert res["config"][k] == replication.demo.QUICK_OVERRIDES[k]
    assert replication.REPLICATION_DEFAULTS["sft_steps"] != replication.demo.QUICK_OVERRIDES["sft_steps"]
    (world,) = res["worlds"]
    assert world["seed"] == 0
    ws = world["warm_start"]
    for k in ("probe_success", "fresh_success"):
        assert 0.0 <= ws[k] <= 1.0
    assert ws["n_fresh"] == ws["n_questions"] * 4  # group_size samples per greedy-wrong question
    # the prior gate (2.0 by default here) ran on the dev world: round 0, then at most 1 more (--quick)
    gate = ws["prior_gate"]
    assert gate["gate"] == replication.REPLICATION_DEFAULTS["prior_gate"] and 1 <= len(gate["rounds"]) <= 2
    assert gate["passed"] == (gate["chosen"]["ratio"] >= 2.0)
    assert [r["sft_steps"] for r in gate["rounds"]] == [25, 30][:len(gate["rounds"])]
    saved = json.load(open(os.path.join(root, "seed0", "warm", "prior_gate.json")))
    assert json.dumps(gate, sort_keys=True) == json.dumps(saved, sort_keys=True)  # NaN-safe comparison
    assert set(world["arms"]) == {"grpo", "rexrag_nocorr", "rexrag", "rapo"}
    before = {a["em_before"] for a in world["arms"].values()}
    assert len(before) == 1  # one warm start for the four arms
    for name, arm in world["arms"].items():
        assert arm["n_heldout"] == 30 and arm["rl_steps"] == 2
        assert set(arm["em_after_per_hop"]) == {"1hop", "2hop", "3hop"}
        # EM after = the per-question dump's mean
        rows = [json.loads(line) for line in open(os.path.join(root, "seed0", name, "eval_rl.jsonl"))]
        assert arm["em_after"] == pytest.approx(100 * np.mean([r["em"] for r in rows]))
        d = arm["diagnostics"]
        assert d["keep_ratio_start"] == pytest.approx(0.125)
        for k in ("groups/all_fail", "groups/rescued", "alpha", "err"):
            assert k in d
        if name == "grpo":
            assert d["probes/created"] in (None, 0) and d["alpha"] == 0.0
        # per-step time and tool calls per trajectory = the means of the per-step log
        assert arm["step_seconds_mean"] == pytest.approx(np.mean([r["time/step"] for r in arm["rl_log"]]))
        assert arm["tool_calls_per_traj"] == pytest.approx(np.mean([r["searches/mean"] for r in arm["rl_log"]]))
        assert arm["tool_calls_per_traj"] > 0
    # the RAPO arm trained on hybrid rollouts from the world's static trace buffer (solver, top-1 of 4 in --quick)
    manifest = json.load(open(os.path.join(root, "seed0", "warm", "trace_buffer", "manifest.json")))
    assert (manifest["n"], manifest["k"]) == (4, 1) and manifest["policy"]["kind"] == "solver"
    assert manifest["counts"]["questions"] == replication.demo.QUICK_OVERRIDES["sft_examples"]
    # greedy held-out behaviour per arm: EM on trap / other questions (weighted back to the overall EM)
    for arm in world["arms"].values():
        b = arm["behaviour"]
        assert 0.0 <= b["self_reflect"] <= 100.0 and b["searches_per_q"] >= 0 and 0 <= b["n_trap"]
    recs = [json.loads(line) for line in open(os.path.join(root, "seed0", "grpo", "eval_rl.jsonl"))]
    b = world["arms"]["grpo"]["behaviour"]
    n_trap = b["n_trap"]
    overall = (b["em_trap"] * n_trap if n_trap else 0.0) + (b["em_other"] * (len(recs) - n_trap) if n_trap < len(recs) else 0.0)
    assert overall / len(recs) == pytest.approx(100 * np.mean([r["em"] for r in recs]))
    rapo_log = world["arms"]["rapo"]["rl_log"]
    assert all("rapo/insertions_per_traj" in r and "rapo/z_ret_mean" in r for r in rapo_log)
    assert sum(r["rapo/insertions_per_traj"] for r in rapo_log) > 0
    assert all("rapo/insertions_per_traj" not in r for r in world["arms"]["grpo"]["rl_log"])
    comps = {c["arms"]: c for c in res["comparisons"]}
    assert set(comps) == {"rexrag - grpo", "rexrag - rexrag_nocorr", "rexrag_nocorr - grpo", "rapo - grpo"}
    c = comps["rexrag - grpo"]
    assert c["mean"] == pytest.approx(world["arms"]["rexrag"]["em_after"] - world["arms"]["grpo"]["em_after"])
    lo, hi = c["bootstrap_interval"]
    assert lo <= c["mean"] <= hi


def test_results_json_alone_gives_the_bootstrap(quick, tmp_path):
    """The per-question EM stored in the JSON equals the dumps, and paired_stats from the JSON alone
    (run dirs gone, as on another machine) equals paired_stats from the dumps."""
    rc, root, out = quick
    res = json.load(open(out))
    world = res["worlds"][0]
    for name, arm in world["arms"].items():
        rows = {r["id"]: r["em"] for r in map(json.loads, open(os.path.join(root, "seed0", name, "eval_rl.jsonl")))}
        assert dict(zip(arm["question_em"]["ids"], arm["question_em"]["em"])) == rows
    from_dumps = replication.paired_stats(res, "grpo", "rexrag", root)
    from_json = replication.paired_stats(res, "grpo", "rexrag", str(tmp_path / "nowhere"))
    assert from_json == from_dumps
    del world["arms"]["grpo"]["question_em"]
    with pytest.raises(replication.BadInput, match="no question_em for world 0 arm grpo"):
        replication.paired_stats(res, "grpo", "rexrag", str(tmp_path / "nowhere"))


def test_resume_reruns_only_the_unfinished_arm(quick, capsys):
    rc, root, out = quick
    res = json.load(open(os.path.join(root, "results.json")))
    grpo_dump = os.path.join(root, "seed0", "grpo", "eval_rl.jsonl")
    mtime = os.path.getmtime(grpo_dump)
    del res["worlds"][0]["arms"]["rexrag"]  # as if killed during the REX-RAG arm
    json.dump(res, open(os.path.join(root, "results.json"), "w"))
    capsys.readouterr()
    assert replication.main(["--quick", "--seeds", "0", "--run_root", root, "--json_out", out]) == 0
    printed = capsys.readouterr().out
    assert "world 0        rexrag:" in printed and "grpo:" not in printed.split("\n\n")[0].split("world 0:")[-1]
    assert os.path.getmtime(grpo_dump) == mtime
    assert set(json.load(open(out))["worlds"][0]["arms"]) == {"grpo", "rexrag_nocorr", "rexrag", "rapo"}


@pytest.mark.parametrize("argv, message", [
    (["--arms", "grpo", "ppo"], "unknown arm 'ppo'"),
    (["--seeds", "0", "x"], "'x' is not an integer"),
    (["--seeds", "1", "1"], "repeats a seed"),
    (["--seeds", "-3"], "negative"),
])
def test_bad_arms_and_seeds_are_one_line_exit_2(tmp_path, capsys, argv, message):
    root = tmp_path / "r"
    assert replication.main(["--quick", "--run_root", str(root), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not root.exists()  # refused before writing anything


def test_run_root_from_other_settings_is_refused_unless_overwrite(tmp_path, capsys):
    root = tmp_path / "r"
    root.mkdir()
    manifest = {"commit": replication.code_commit(), "config": {"rl_steps": 999}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    (root / "results.json").write_text('{"worlds": [{"seed": 0, "arms": {}}]}')
    assert replication.main(["--quick", "--seeds", "0", "--run_root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "settings" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert json.loads((root / "manifest.json").read_text()) == manifest  # untouched
    assert (root / "results.json").read_text() == '{"worlds": [{"seed": 0, "arms": {}}]}'
    other = dict(manifest, commit="0" * 40, config=None)
    (root / "manifest.json").write_text(json.dumps(other))
    with pytest.raises(replication.BadInput, match="code commit"):
        replication.open_run_root(str(root), {"commit": manifest["commit"], "config": None}, overwrite=False)
    fresh = replication.open_run_root(str(root), {"commit": manifest["commit"], "config": None}, overwrite=True)
    assert fresh == {"worlds": []} and not (root / "results.json").exists()


def test_paired_intervals_hand_computed(tmp_path):
    """t over worlds and the bootstrap on three worlds with known per-question EM."""
    res = {"worlds": []}
    rng = np.random.default_rng(0)
    for seed, (ea, eb) in enumerate([(0.2, 0.3), (0.3, 0.35), (0.25, 0.4)]):
        for arm, p in (("grpo", ea), ("rexrag", eb)):
            d = tmp_path / f"seed{seed}" / arm
            d.mkdir(parents=True)
            em = (rng.random(200) < p).astype(float)
            with open(d / "eval_rl.jsonl", "w") as f:
                for i, e in enumerate(em):
                    f.write(json.dumps({"id": f"q{i}", "em": e}) + "\n")
        res["worlds"].append({"seed": seed, "arms": {
            a: {"em_after": 100 * np.mean([json.loads(x)["em"] for x in open(tmp_path / f"seed{seed}" / a / "eval_rl.jsonl")])}
            for a in ("grpo", "rexrag")}})
    st = replication.paired_stats(res, "grpo", "rexrag", str(tmp_path), draws=500)
    diffs = [w["arms"]["rexrag"]["em_after"] - w["arms"]["grpo"]["em_after"] for w in res["worlds"]]
    assert st["per_world"] == pytest.approx(diffs) and st["mean"] == pytest.approx(np.mean(diffs))
    half = 4.303 * np.std(diffs, ddof=1) / np.sqrt(3)  # t_{2, 0.975}
    assert st["t_interval"] == pytest.approx([np.mean(diffs) - half, np.mean(diffs) + half])
    lo, hi = st["bootstrap_interval"]
    assert lo < np.mean(diffs) < hi and hi - lo < 2 * half  # question-level noise: narrower than t with df 2


def test_warm_from_copies_a_finished_warm_start_and_refuses_other_settings(quick, tmp_path, capsys):
    """--warm_from: the warm start is copied from the other run root (no SFT here: same EM before, the source
    recorded); a source made with other warm-start settings is refused in one line, exit 2."""
    rc, root, out = quick
    capsys.readouterr()
    new = str(tmp_path / "again")
    assert replication.main(["--quick", "--seeds", "0", "--arms", "grpo", "--run_root", new, "--warm_from", root]) == 0
    res = json.load(open(os.path.join(new, "results.json")))
    src = json.load(open(out))
    assert res["warm_from"]["0"]["run_root"] == os.path.abspath(root)
    assert res["worlds"][0]["warm_start"]["em_before"] == src["worlds"][0]["warm_start"]["em_before"]
    assert res["worlds"][0]["warm_start"]["probe_success"] == src["worlds"][0]["warm_start"]["probe_success"]
    assert "== sft" not in capsys.readouterr().out  # not trained here
    for f in ("config.json", "model.safetensors"):
        a, b = (os.path.join(r, "seed0", "warm", "warmstart_model", f) for r in (new, root))
        assert open(a, "rb").read() == open(b, "rb").read()
    rc = replication.main(["--quick", "--seeds", "0", "--arms", "grpo", "--run_root", str(tmp_path / "other"),
                           "--warm_from", root, "--gin_param", "DemoConfig.sft_steps = 3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "other settings (sft_steps)" in err[0]


def test_behaviour_breakdown_hand_computed(tmp_path):
    """EM on trap / other questions, self-reflection, searches and changed/fixed/broken vs the warm start,
    on hand-written dumps of 4 questions of a tiny world."""
    from rexrag_jax.data.synthetic_world import WorldConfig, generate_world
    from rexrag_jax.data.warmstart import has_trap, pick_trap_relations

    world = generate_world(WorldConfig(seed=0))
    traps = pick_trap_relations(0, 3)
    qs = world.test
    trap_qs = [e for e in qs if has_trap(world, e, traps)][:2]
    other_qs = [e for e in qs if not has_trap(world, e, traps)][:2]
    assert len(trap_qs) == 2 and len(other_qs) == 2
    refl = "<think> Perhaps I've overlooked something. </think>"
    warm = [(trap_qs[0], "<answer> a </answer>", 0), (trap_qs[1], "<answer> b </answer>", 0),
            (other_qs[0], "<search> q </search><answer> c </answer>", 1), (other_qs[1], "<answer> d </answer>", 1)]
    after = [(trap_qs[0], refl + "<search> q </search><search> r </search><answer> x </answer>", 1),  # fixed
             (trap_qs[1], "<answer> b </answer>", 0),                                                # unchanged
             (other_qs[0], "<search> q </search><answer> c </answer>", 1),                          # unchanged
             (other_qs[1], "<answer> e </answer>", 0)]                                               # broken
    for name, rows in (("warm.jsonl", warm), ("after.jsonl", after)):
        with open(tmp_path / name, "w") as f:
            for ex, resp, em in rows:
                f.write(json.dumps({"id": ex.id, "response": resp, "em": em}) + "\n")
    b = replication.behaviour_breakdown(world, traps, str(tmp_path / "after.jsonl"), str(tmp_path / "warm.jsonl"))
    assert b["n_trap"] == 2 and b["em_trap"] == 50.0 and b["em_other"] == 50.0
    assert b["self_reflect"] == 25.0 and b["em_when_self_reflecting"] == 100.0
    assert b["searches_per_q"] == (2 + 0 + 1 + 0) / 4
    assert (b["changed"], b["fixed"], b["broken"]) == (50.0, 25.0, 25.0)
    w = replication.behaviour_breakdown(world, traps, str(tmp_path / "warm.jsonl"))
    assert "changed" not in w and w["em_trap"] == 0.0 and w["self_reflect"] == 0.0


def test_combine_pools_worlds_of_several_results_files(quick, tmp_path, capsys):
    """--combine: the worlds of two results files as one study; the t interval over worlds by hand; the
    prior subset by the warm start's probe/fresh ratio; a seed in both files is exit 2."""
    rc, root, out = quick
    res = json.load(open(out))
    other = json.loads(json.dumps(res))
    w = other["worlds"][0]
    w["seed"] = 5
    w["arms"]["rexrag"]["em_after"] += 3.0
    w["warm_start"]["ratio"] = 10.0
    res["worlds"][0]["warm_start"]["ratio"] = 0.5
    f1, f2, f3 = (str(tmp_path / n) for n in ("a.json", "b.json", "c.json"))
    json.dump(res, open(f1, "w")), json.dump(other, open(f2, "w"))
    assert replication.main(["--combine", f1, f2, "--json_out", f3]) == 0
    comb = json.load(open(f3))
    assert comb["prior_worlds"] == [5]
    c = next(c for c in comb["comparisons"] if c["subset"] == "all" and c["arms"] == "rexrag - grpo")
    d0 = res["worlds"][0]["arms"]["rexrag"]["em_after"] - res["worlds"][0]["arms"]["grpo"]["em_after"]
    diffs = [d0, d0 + 3.0]
    assert c["seeds"] == [0, 5] and c["per_world"] == pytest.approx(diffs)
    half = 12.706 * np.std(diffs, ddof=1) / np.sqrt(2)
    assert c["t_interval"] == pytest.approx([np.mean(diffs) - half, np.mean(diffs) + half])
    assert "bootstrap_interval" in c  # both worlds carry per-question EM
    p = next(c for c in comb["comparisons"] if c["subset"] == "prior" and c["arms"] == "rexrag - grpo")
    assert p["seeds"] == [5] and p["mean"] == pytest.approx(d0 + 3.0)
    capsys.readouterr()
    assert replication.main(["--combine", f1, f1]) == 2
    assert "world 0 is also in an earlier file" in capsys.readouterr().err
