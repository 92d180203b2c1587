"""launch/*.sh: exact gcloud commands under --dry-run, quoting that survives two shells, retries and
recovery against a fake gcloud, and shellcheck over every script."""
import os
import pathlib
import shlex
import shutil
import subprocess

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parents[2] / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh")) + sorted(LAUNCH.glob("remote/*.sh"))
ENTRY = [p for p in SCRIPTS if p.name not in ("common.sh", "lib.sh")]
BASE = ["--name", "rr", "--zone", "us-west4-a"]


# Every run sees this gcloud first unless a test installs its own fake: a dry run that reached the real
# gcloud would be a bug, and must fail loudly instead of talking to a cloud project.
GUARD_GCLOUD = "#!/usr/bin/env bash\necho \"guard: real gcloud would have run: $*\" >&2\nexit 97\n"


@pytest.fixture(scope="module", autouse=True)
def guard_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("guard")
    (d / "gcloud").write_text(GUARD_GCLOUD)
    (d / "gcloud").chmod(0o755)
    os.environ["LAUNCH_TEST_GUARD_PATH"] = f"{d}:{os.environ['PATH']}"
    yield
    os.environ.pop("LAUNCH_TEST_GUARD_PATH", None)


def sh(script, *args, env=None, stdin=None, check=True):
    full_env = {k: v for k, v in os.environ.items() if k not in ("TPU_NAME", "ZONE", "PROJECT", "RUN_DIR")}
    full_env["PATH"] = os.environ["LAUNCH_TEST_GUARD_PATH"]
    full_env.update(env or {})
    r = subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True, env=full_env,
                       input=stdin, timeout=60)
    if check:
        assert r.returncode == 0, f"{script} {args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def dry(script, *args, **kw):
    return sh(script, *args, "--dry-run", **kw).stdout.splitlines()


def wait_for_text(path, text, timeout=5.0):
    """Log files are written by `tee` process substitutions that may outlive the script by a moment."""
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.05)
    return False


def remote_command(line):
    """argv of the --command=... of a printed `gcloud ... ssh` line, after both shells' quoting."""
    (cmd,) = [a for a in shlex.split(line) if a.startswith("--command=")]
    return shlex.split(cmd[len("--command="):])


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (Debian: apt-get install -y shellcheck); it lints launch/*.sh")
    r = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=LAUNCH.parent)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", ENTRY, ids=lambda p: p.name)
def test_every_script_has_help_and_dry_run(script):
    rel = script.relative_to(LAUNCH)
    out = sh(str(rel), "--help").stdout
    assert "usage:" in out and "--dry-run" in out
    assert os.access(script, os.X_OK)


@pytest.mark.parametrize("accel,version,extra,flag", [
    ("v5e-8", "v2-alpha-tpuv5-lite", ["--spot"], ["--spot"]),
    ("v5litepod-8", "v2-alpha-tpuv5-lite", [], []),
    ("v4-8", "tpu-ubuntu2204-base", ["--preemptible"], ["--preemptible"]),
    ("v5p-8", "v2-alpha-tpuv5", [], []),
    ("v6e-8", "v2-alpha-tpuv6e", ["--version", "custom-rt"], []),
])
def test_create_vm(accel, version, extra, flag):
    out = dry("create.sh", *BASE, "--accelerator", accel, *extra)
    if "--version" in extra:
        version = "custom-rt"
    accel = accel.replace("v5e-", "v5litepod-")
    assert out == [" ".join(["gcloud compute tpus tpu-vm create rr --zone=us-west4-a",
                             f"--accelerator-type={accel} --version={version}", *flag])]


def test_create_queued_with_project_and_network():
    out = dry("create.sh", *BASE, "--project", "my-proj", "--accelerator", "v4-32", "--queued", "--spot",
              "--valid-until", "6h", "--network", "net1", "--subnetwork", "sub1")
    assert out == [
        "gcloud compute tpus queued-resources create rr-qr --node-id=rr --zone=us-west4-a --project=my-proj "
        "--accelerator-type=v4-32 --runtime-version=tpu-ubuntu2204-base --spot --network=net1 "
        "--subnetwork=sub1 --valid-until-duration=6h",
        "gcloud compute tpus queued-resources describe rr-qr --zone=us-west4-a --project=my-proj "
        "--format='value(state.state)'"]


def test_setup_copies_to_all_workers_and_swaps_atomically(tmp_path):
    out = dry("setup.sh", *BASE, "--log-dir", str(tmp_path), "--jax-version", "0.4.38")
    assert out[0] == f"mkdir -p {tmp_path}"
    assert out[1].startswith(f"tar -czf {tmp_path}/rexrag_jax.tgz -C {LAUNCH.parent} --exclude-vcs")
    assert out[2] == (f"gcloud compute tpus tpu-vm scp {tmp_path}/rexrag_jax.tgz rr:rexrag_jax.tgz "
                      "--zone=us-west4-a --worker=all")
    assert out[3].startswith("gcloud compute tpus tpu-vm ssh rr --zone=us-west4-a --worker=all --command=")
    argv = remote_command(out[3])
    assert "mv rexrag_jax.new rexrag_jax" in " ".join(argv)
    assert argv[-8:] == ["bash", "rexrag_jax/launch/remote/setup_worker.sh", "--venv", "rexrag_venv",
                         "--remote-dir", "rexrag_jax", "--jax-version", "0.4.38"][-8:]
    assert len(out) == 4


def test_up_runs_every_step_in_order(tmp_path):
    out = dry("up.sh", *BASE, "--accelerator", "v5p-8", "--run-dir", "gs://bkt/run1", "--log-dir", str(tmp_path),
              "--retriever-index", "gs://bkt/index",
              "--gin-file", "gin/rexrag.gin", "--gin-file", "gin/model/qwen2.5-3b.gin")
    steps = [ln.split(" --")[0] for ln in out]
    assert steps == ["gcloud compute tpus tpu-vm create rr", f"mkdir -p {tmp_path}", f"tar -czf {tmp_path}/rexrag_jax.tgz -C {LAUNCH.parent}",
                     f"gcloud compute tpus tpu-vm scp {tmp_path}/rexrag_jax.tgz rr:rexrag_jax.tgz",
                     "gcloud compute tpus tpu-vm ssh rr", "gcloud compute tpus tpu-vm ssh rr",
                     "gcloud compute tpus tpu-vm ssh rr", "gcloud compute tpus tpu-vm describe rr",
                     "gcloud compute tpus tpu-vm ssh rr"]
    assert "--worker=0" in out[5] and remote_command(out[5])[1] == "rexrag_jax/launch/remote/start_retriever.sh"
    assert remote_command(out[5])[-6:] == ["--index-dir", "gs://bkt/index", "--port", "8000", "--timeout", "1800"]
    assert "--worker=all" in out[6] and remote_command(out[6])[1] == "rexrag_jax/launch/remote/kill_tpu.sh"
    assert out[7] == ("gcloud compute tpus tpu-vm describe rr --zone=us-west4-a "
                      "--format='value(networkEndpoints[0].ipAddress)'")
    train = remote_command(out[8])
    assert "--worker=all" in out[8] and train[:2] == ["bash", "rexrag_jax/launch/remote/start_train.sh"]
    assert train[train.index("--run-dir") + 1] == "gs://bkt/run1"
    assert train[train.index("--retriever-url") + 1] == "http://WORKER0_IP:8000/retrieve"
    assert [train[i + 1] for i, a in enumerate(train) if a == "--gin-file"] == ["gin/rexrag.gin",
                                                                                "gin/model/qwen2.5-3b.gin"]


def test_gin_binding_quoting_survives_both_shells():
    tricky = "RAPO_NOTE = 'it''s a \"test\" $HOME `x`'"
    out = dry("train.sh", *BASE, "--run-dir", "gs://b/r", "--gin-file", "gin/rexrag.gin",
              "--gin-binding", tricky, "--retriever-url", "http://10.1.2.3:8000/retrieve")
    assert len(out) == 2  # kill + start; no describe with an explicit retriever URL
    argv = remote_command(out[1])
    assert argv[argv.index("--gin-binding") + 1] == tricky
    # ... and the worker-side script turns it into the exact `rexrag train` argv.
    remote = dry("remote/start_train.sh", *argv[2:])
    assert remote[0].startswith("cd ")
    cmd = shlex.split(remote[1])
    assert cmd[0] == "env" and "REXRAG_RUN_DIR=gs://b/r" in cmd and \
        "REXRAG_RETRIEVER_URL=http://10.1.2.3:8000/retrieve" in cmd
    i = cmd.index("train")
    assert cmd[i - 1].endswith("/rexrag_venv/bin/rexrag")
    assert cmd[i + 1:] == ["--gin_file", "gin/rexrag.gin", "--gin_bindings", tricky,
                           "--gin_bindings", "RUN_DIR = 'gs://b/r'",
                           "--gin_bindings", "RETRIEVER_URL = 'http://10.1.2.3:8000/retrieve'"]


def test_trainer_env_passthrough():
    flags = "--xla_tpu_enable_latency_hiding_scheduler=true --xla_enable_async_all_gather=true"
    out = dry("train.sh", *BASE, "--run-dir", "gs://b/r", "--gin-file", "g.gin", "--retriever-url", "http://h:1/retrieve",
              "--env", f"LIBTPU_INIT_ARGS={flags}")
    argv = remote_command(out[-1])
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    # the compile cache in the run's bucket (outside the run dir), then the user's own environment
    assert envs == ["JAX_COMPILATION_CACHE_DIR=gs://b/rexrag_xla_cache", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1",
                    f"LIBTPU_INIT_ARGS={flags}"]
    cmd = shlex.split(dry("remote/start_train.sh", *argv[2:])[-1])
    assert cmd[:6] == ["env", "REXRAG_RUN_DIR=gs://b/r", "REXRAG_RETRIEVER_URL=http://h:1/retrieve", *envs]
    r = sh("train.sh", *BASE, "--env", "not an assignment", "--dry-run", check=False)
    assert r.returncode == 2 and "--env expects KEY=VALUE" in r.stderr


@pytest.mark.parametrize("flag,expected", [(["--compile-cache", "gs://c/xla"], "gs://c/xla"),
                                           (["--compile-cache", "/mnt/shared/xla"], "/mnt/shared/xla"),
                                           (["--compile-cache", "none"], None)])
def test_compile_cache_flag(flag, expected):
    out = dry("train.sh", *BASE, "--run-dir", "gs://b/r/x", "--gin-file", "g.gin", "--retriever-url", "http://h:1/r", *flag)
    argv = remote_command(out[-1])
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    caches = [e.split("=", 1)[1] for e in envs if e.startswith("JAX_COMPILATION_CACHE_DIR=")]
    assert caches == ([expected] if expected else [])
    r = sh("train.sh", *BASE, "--run-dir", "gs://b/r", "--gin-file", "g.gin", "--compile-cache", "rel/dir", "--dry-run",
           check=False)
    assert r.returncode == 2 and "--compile-cache must be" in r.stderr


def test_remote_scripts_dry_run():
    kill = dry("remote/kill_tpu.sh")
    assert any("sudo lsof -t /dev/accel*" in ln and "xargs -r sudo kill -9" in ln for ln in kill)
    assert kill[-1] == "sudo rm -f /tmp/libtpu_lockfile"
    retr = shlex.split(dry("remote/start_retriever.sh", "--index-dir", "/mnt/idx", "--port", "8123")[-1])
    assert retr[:2] == ["env", "JAX_PLATFORMS=cpu"] and retr[3:] == [
        "serve-retriever", "--index_dir", "/mnt/idx", "--host", "0.0.0.0", "--port", "8123"]
    out = dry("remote/start_retriever.sh", "--index-dir", "gs://b/idx", "--gin-file", "gin/retriever/e5_scann.gin")
    local = os.path.expanduser("~/rexrag_index")
    assert out[-2] == f"gcloud storage rsync -r gs://b/idx {local}"  # GCS index copied to local disk first
    assert shlex.split(out[-1])[3:] == ["serve-retriever", "--index_dir", local, "--host", "0.0.0.0", "--port",
                                        "8000", "--gin_file",
                                        os.path.expanduser("~/rexrag_jax/gin/retriever/e5_scann.gin")]
    setup = dry("remote/setup_worker.sh", "--jax-version", "0.4.38")
    assert any("'jax[tpu]==0.4.38'" in ln for ln in setup) and setup[-2].endswith("pip install -q -e "
                                                                                    + os.path.expanduser("~/rexrag_jax"))


@pytest.mark.parametrize("accel,workers", [("v4-8", 1), ("v4-32", 4), ("v5p-128", 16), ("v5litepod-8", 1),
                                           ("v5litepod-16", 4), ("v5litepod-256", 64), ("v6e-8", 1),
                                           ("v6e-64", 16)])
def test_fetch_logs_one_scp_per_worker(accel, workers, tmp_path):
    out = dry("logs.sh", *BASE, "--accelerator", accel, "--fetch", "--log-dir", str(tmp_path))
    scps = [ln for ln in out if ln.startswith("gcloud")]
    assert scps == [f"gcloud compute tpus tpu-vm scp --recurse rr:rexrag_logs {tmp_path}/worker{w} "
                    f"--zone=us-west4-a --worker={w}" for w in range(workers)]


def test_tail_logs():
    assert dry("logs.sh", *BASE, "--worker", "3", "--file", "retriever", "--lines", "50") == [
        "gcloud compute tpus tpu-vm ssh rr --zone=us-west4-a --worker=3 --command='tail -n 50 -F "
        "rexrag_logs/retriever.log'"]
    out = dry("logs.sh", *BASE, "--no-follow", "--ssh-flag=--internal-ip")
    assert out == ["gcloud compute tpus tpu-vm ssh rr --zone=us-west4-a --worker=0 --internal-ip "
                   "--command='tail -n 200 rexrag_logs/train.log'"]


RESUME = [*BASE, "--run-dir", "gs://b/r", "--gin-file", "gin/rexrag.gin", "--log-dir", "/tmp/unused-launch-logs",
          "--retriever-index", "/mnt/disks/index"]


def test_resume_after_preemption_recreates_then_restarts():
    out = dry("resume.sh", *RESUME, "--spot")
    assert out[0] == "gcloud compute tpus tpu-vm describe rr --zone=us-west4-a --format='value(state)'"
    assert out[1] == "gcloud compute tpus tpu-vm delete rr --zone=us-west4-a --quiet"
    assert out[2].startswith("gcloud compute tpus tpu-vm create rr --zone=us-west4-a") and out[2].endswith("--spot")
    assert "start_train.sh" in out[-1] and "--worker=all" in out[-1]


def test_resume_healthy_only_restarts_trainer():
    out = dry("resume.sh", *RESUME, "--assume-state", "READY")
    assert not any(" create " in ln or " delete " in ln or " scp " in ln for ln in out)
    assert [remote_command(ln)[1].rsplit("/", 1)[1] for ln in out if "--command=" in ln] == [
        "start_retriever.sh", "kill_tpu.sh", "start_train.sh"]


def test_resume_queued_not_found_creates_without_delete():
    out = dry("resume.sh", *RESUME, "--queued", "--assume-state", "NOT_FOUND")
    assert out[0].startswith("gcloud compute tpus queued-resources describe rr-qr")
    assert out[1].startswith("gcloud compute tpus queued-resources create rr-qr --node-id=rr")
    assert not any("delete" in ln for ln in out)
    out = dry("resume.sh", *RESUME, "--queued", "--assume-state", "SUSPENDED")
    assert out[1] == "gcloud compute tpus queued-resources delete rr-qr --zone=us-west4-a --force --quiet"


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--zone", "z"], "--name is required"),
    ([*BASE, "--accelerator", "v9-8"], "--accelerator 'v9-8' not understood"),
    ([*BASE, "--spot", "--preemptible"], "mutually exclusive"),
    ([*BASE, "--retries", "x"], "--retries must be a non-negative integer"),
    ([*BASE, "--zone"], "--zone needs a value"),
    ([*BASE, "--retries", "--log-dir", "/tmp"], "--retries needs a value"),
    ([*BASE, "--remote-dir", "/abs; rm -rf x"], "--remote-dir must be a plain path"),
])
def test_bad_arguments(args, message):
    r = sh("create.sh", *args, "--dry-run", check=False)
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""


def test_up_checks_everything_before_creating_anything():
    r = sh("up.sh", *BASE, "--run-dir", "gs://b/r", "--gin-file", "g.gin", "--dry-run", check=False)
    assert r.returncode == 2 and "--retriever-index" in r.stderr and r.stdout == ""


def test_train_requires_gcs_run_dir_and_gin():
    r = sh("train.sh", *BASE, "--run-dir", "/local/dir", "--gin-file", "g.gin", "--dry-run", check=False)
    assert r.returncode == 2 and "--run-dir must be a GCS path" in r.stderr
    r = sh("train.sh", *BASE, "--run-dir", "gs://b/r", "--dry-run", check=False)
    assert r.returncode == 2 and "--gin-file is required" in r.stderr and r.stdout == ""


# ---- real runs against a fake gcloud on PATH ---------------------------------------------------------
FAKE_GCLOUD = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$FAKE_DIR/calls"
n=$(cat "$FAKE_DIR/count" 2>/dev/null || echo 0); echo $((n + 1)) > "$FAKE_DIR/count"
if (( n < ${FAKE_FAILS:-0} )); then echo "transient error $n" >&2; exit 1; fi
case "$*" in
  *"describe"*"value(state)"*) echo "${FAKE_STATE:-READY}" ;;
  *"ipAddress"*) echo 10.0.0.2 ;;
esac
"""


@pytest.fixture
def fake_gcloud(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}
    return tmp_path, env


def test_retries_with_backoff_then_succeeds(fake_gcloud):
    d, env = fake_gcloud
    r = sh("create.sh", *BASE, "--retry-delay", "0", "--log-dir", str(d / "logs"), env={**env, "FAKE_FAILS": "2"})
    calls = (d / "calls").read_text().splitlines()
    assert len(calls) == 3 and len(set(calls)) == 1
    assert calls[0] == "compute tpus tpu-vm create rr --zone=us-west4-a --accelerator-type=v5litepod-8 " \
                       "--version=v2-alpha-tpuv5-lite"
    assert r.stderr.count("failed; retrying") == 2
    assert wait_for_text(d / "logs" / "create.log", "transient error 1")


def test_gives_up_after_retries(fake_gcloud):
    d, env = fake_gcloud
    r = sh("create.sh", *BASE, "--retry-delay", "0", "--retries", "2", "--log-dir", str(d / "logs"),
           env={**env, "FAKE_FAILS": "5"}, check=False)
    assert r.returncode != 0 and "giving up after 2 attempts" in r.stderr
    assert len((d / "calls").read_text().splitlines()) == 2


def test_resume_on_healthy_vm_uses_worker0_ip(fake_gcloud):
    d, env = fake_gcloud
    sh("resume.sh", *BASE, "--run-dir", "gs://b/r", "--gin-file", "gin/rexrag.gin", "--retry-delay", "0",
       "--log-dir", str(d / "logs"), "--retriever-index", "/mnt/idx", env=env)
    calls = (d / "calls").read_text().splitlines()
    assert calls[0] == "compute tpus tpu-vm describe rr --zone=us-west4-a --format=value(state)"
    assert "start_train.sh" in calls[-1] and "--retriever-url http://10.0.0.2:8000/retrieve" in calls[-1]
    assert not any(" create " in c or " delete " in c for c in calls)


def test_resume_after_preemption_real(fake_gcloud):
    d, env = fake_gcloud
    repo = d / "repo"  # a tiny tree to copy instead of the live checkout
    (repo / "rexrag_jax").mkdir(parents=True)
    (repo / "rexrag_jax" / "x.py").write_text("x = 1\n")
    (repo / ".git").mkdir()
    (repo / ".git" / "HEAD").write_text("ref\n")
    logs = d / "logs"
    sh("resume.sh", *BASE, "--run-dir", "gs://b/r", "--gin-file", "gin/rexrag.gin", "--retry-delay", "0",
       "--log-dir", str(logs), "--retriever-index", "/mnt/idx", env={**env, "FAKE_STATE": "PREEMPTED", "REXRAG_REPO_ROOT": str(repo)})
    calls = (d / "calls").read_text().splitlines()
    assert [c.split(" rr")[0] for c in calls] == [
        "compute tpus tpu-vm describe", "compute tpus tpu-vm delete", "compute tpus tpu-vm create",
        "compute tpus tpu-vm scp " + str(logs / "rexrag_jax.tgz"), "compute tpus tpu-vm ssh",
        "compute tpus tpu-vm ssh", "compute tpus tpu-vm ssh", "compute tpus tpu-vm describe",
        "compute tpus tpu-vm ssh"]
    names = subprocess.run(["tar", "-tzf", str(logs / "rexrag_jax.tgz")], capture_output=True, text=True).stdout
    assert "./rexrag_jax/x.py" in names.split() and ".git" not in names
    assert "--retriever-url http://10.0.0.2:8000/retrieve" in calls[-1]
    assert wait_for_text(logs / "resume.log", "rr is PREEMPTED: recreating it")


def test_teardown_asks_for_confirmation(fake_gcloud):
    d, env = fake_gcloud
    r = sh("teardown.sh", *BASE, "--log-dir", str(d / "logs"), env=env, stdin="n\n", check=False)
    assert r.returncode == 2 and "not deleted" in r.stderr and not (d / "calls").exists()
    sh("teardown.sh", *BASE, "--yes", "--log-dir", str(d / "logs"), env=env)
    assert (d / "calls").read_text().splitlines() == ["compute tpus tpu-vm delete rr --zone=us-west4-a --quiet"]
