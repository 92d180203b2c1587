# shellcheck shell=bash disable=SC2034  # variables here are read by the scripts that source this file
# Shared by every launch/*.sh: flag parsing, the `run` wrapper (prints instead of running under
# --dry-run), retries with exponential backoff, and the gcloud steps (create, setup, retriever, train,
# delete). Scripts source this file, set USAGE, call `parse_args "$@"`, then call the do_* steps.

set -euo pipefail

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="${REXRAG_REPO_ROOT:-$(cd "$LAUNCH_DIR/.." && pwd)}"  # the tree that setup.sh copies

# ---- defaults (environment variables stand in for flags) -------------------------------------------
NAME="${TPU_NAME:-}"
ZONE="${ZONE:-${CLOUDSDK_COMPUTE_ZONE:-}}"
PROJECT="${PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}"
ACCELERATOR="${ACCELERATOR:-v5litepod-8}"
RUNTIME_VERSION="${RUNTIME_VERSION:-}"
SPOT=0
PREEMPTIBLE=0
QUEUED=0
QR_NAME=""
VALID_UNTIL=""
RESERVED=0
NETWORK=""
SUBNETWORK=""
NUM_WORKERS=""
RUN_DIR="${RUN_DIR:-}"
GIN_FILES=()
GIN_BINDINGS=()
TRAIN_ENV=()
COMPILE_CACHE="${COMPILE_CACHE:-}"
RETRIEVER_INDEX="${RETRIEVER_INDEX:-}"
RETRIEVER_GIN="${RETRIEVER_GIN:-}"
RETRIEVER_PORT=8000
RETRIEVER_WORKER=0
RETRIEVER_URL=""
RETRIEVER_TIMEOUT=1800
REMOTE_DIR="rexrag_jax"      # relative to the remote home directory
VENV="rexrag_venv"
JAX_VERSION=""
LOG_DIR=""
RETRIES=5
RETRY_DELAY=10
SSH_FLAGS=()
WORKER=0
FOLLOW=1
FETCH=0
LOG_FILE="train"
LINES=200
WATCH=0
POLL=300
ASSUME_STATE=""
YES=0
DRY_RUN=0

# shellcheck disable=SC2016  # literal backticks in help text
COMMON_USAGE='
Common options:
  --name NAME              TPU VM name (env TPU_NAME)                         [required]
  --zone ZONE              e.g. us-central2-b, us-west4-a (env ZONE)           [required]
  --project PROJECT        GCP project (env PROJECT; default: gcloud config)
  --accelerator TYPE       v4-8, v4-32, v5litepod-8 (alias v5e-8), v5litepod-16, v5p-8, v5p-64,
                           v6e-8 ...                                           [v5litepod-8]
  --version RUNTIME        TPU runtime (default per generation: v4 tpu-ubuntu2204-base,
                           v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e)
  --spot | --preemptible   capacity type
  --queued                 use a queued resource (--qr-name, --valid-until 6h, --reserved)
  --network NET, --subnetwork SUB
  --num-workers N          hosts in the slice (default: derived from the accelerator type)
  --run-dir gs://B/RUN     GCS run dir: checkpoints, TensorBoard, trajectory dumps (env RUN_DIR)
  --gin-file F             (repeatable) trainer gin files, relative to the repo
  --gin-binding B          (repeatable) trainer gin bindings, e.g. "MAX_STEPS=1005"
  --env KEY=VALUE          (repeatable) environment for the trainer, e.g. LIBTPU_INIT_ARGS=...
  --compile-cache D        persistent XLA compilation cache that every worker and every restart shares:
                           gs://... or an absolute path, or "none" (env COMPILE_CACHE)
                           [gs://<bucket of --run-dir>/rexrag_xla_cache]
  --retriever-index D      index dir built by `rexrag build-index`: a path on the worker, or gs://...
                           (synced to ~/rexrag_index first) (env RETRIEVER_INDEX)
  --retriever-gin F        extra gin file for `rexrag serve-retriever` (the index dir'"'"'s config.gin
                           is always read), e.g. gin/retriever/e5_scann.gin
  --retriever-port P       [8000];  --retriever-worker W: worker that hosts it [0]
  --retriever-url URL      use an external retriever (skip starting one)
  --remote-dir D, --venv D code / virtualenv dirs under the remote home [rexrag_jax, rexrag_venv]
  --jax-version V          pin jax[tpu]==V on the workers (default: latest)
  --ssh-flag F             (repeatable) extra flag for gcloud ssh/scp, e.g. --ssh-flag=--internal-ip
  --log-dir D              local logs                                    [launch_logs/NAME]
  --retries N              attempts per gcloud ssh/scp/create            [5]
  --retry-delay S          first backoff in seconds, doubled each retry  [10]
  --dry-run                print the exact commands instead of running them
  -h, --help               this help
'

# ---- messages ---------------------------------------------------------------------------------------
log() { printf '[launch %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

# start_log STEP: mirror this script's output into LOG_DIR/STEP.log (not under --dry-run).
start_log() {
  if (( DRY_RUN )); then return 0; fi
  mkdir -p "$LOG_DIR"
  exec > >(tee -a "$LOG_DIR/$1.log") 2> >(tee -a "$LOG_DIR/$1.log" >&2)
  log "logging to $LOG_DIR/$1.log"
}

usage() {
  printf '%s\n%s' "$USAGE" "$COMMON_USAGE"
}

# ---- quoting and running ----------------------------------------------------------------------------
# quote ARG: the argument as a shell word (bare when safe, else single-quoted), so a printed command can
# be pasted back into a shell.
quote() {
  local s="$1"
  if [[ -n "$s" && "$s" =~ ^[A-Za-z0-9_./:=,@%+^-]+$ ]]; then
    printf '%s' "$s"
  elif [[ "$s" =~ ^(--[A-Za-z0-9-]+=)(.*)$ ]]; then
    # --flag='value' reads better than '--flag=value'; both are the same word to the shell.
    printf '%s' "${BASH_REMATCH[1]}"
    quote "${BASH_REMATCH[2]}"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

quote_cmd() {
  local out="" a
  for a in "$@"; do out+="${out:+ }$(quote "$a")"; done
  printf '%s' "$out"
}

# run CMD...: under --dry-run print the command on stdout (one line) and succeed; otherwise run it.
run() {
  if (( DRY_RUN )); then
    printf '%s\n' "$(quote_cmd "$@")"
    return 0
  fi
  log "+ $(quote_cmd "$@")"
  "$@"
}

# retry CMD...: up to RETRIES attempts, sleeping RETRY_DELAY, 2*RETRY_DELAY, ... in between.
retry() {
  if (( DRY_RUN )); then run "$@"; return 0; fi
  local attempt=1 delay="$RETRY_DELAY"
  until run "$@"; do
    if (( attempt >= RETRIES )); then
      log "giving up after $attempt attempts: $(quote_cmd "$@")"
      return 1
    fi
    log "attempt $attempt/$RETRIES failed; retrying in ${delay}s"
    sleep "$delay"
    attempt=$((attempt + 1))
    delay=$((delay * 2))
  done
}

# ---- argument parsing -------------------------------------------------------------------------------
# Accepts "--flag value" and "--flag=value".
parse_args() {
  while (($#)); do
    local flag="$1" value="" has_inline=0
    if [[ "$flag" == --*=* ]]; then value="${flag#*=}"; flag="${flag%%=*}"; has_inline=1; fi
    case "$flag" in
      -h|--help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --spot) SPOT=1 ;;
      --preemptible) PREEMPTIBLE=1 ;;
      --queued) QUEUED=1 ;;
      --reserved) RESERVED=1 ;;
      --no-follow) FOLLOW=0 ;;
      --fetch) FETCH=1 ;;
      --watch) WATCH=1 ;;
      --yes) YES=1 ;;
      --name|--zone|--project|--accelerator|--version|--qr-name|--valid-until|--network|--subnetwork|\
      --num-workers|--run-dir|--gin-file|--gin-binding|--retriever-gin|--retriever-port|--retriever-worker|\
      --retriever-url|--retriever-timeout|--retriever-index|--remote-dir|--venv|--jax-version|--ssh-flag|--log-dir|--retries|\
      --retry-delay|--worker|--file|--lines|--poll|--assume-state|--env|--compile-cache)
        if (( ! has_inline )); then
          # A following flag is never a value: `--zone --dry-run` must not drop the --dry-run.
          if (($# < 2)) || [[ "$2" == --* ]]; then die "$flag needs a value (see --help)"; fi
          value="$2"; shift
        fi
        case "$flag" in
          --name) NAME="$value" ;;
          --zone) ZONE="$value" ;;
          --project) PROJECT="$value" ;;
          --accelerator) ACCELERATOR="$value" ;;
          --version) RUNTIME_VERSION="$value" ;;
          --qr-name) QR_NAME="$value" ;;
          --valid-until) VALID_UNTIL="$value" ;;
          --network) NETWORK="$value" ;;
          --subnetwork) SUBNETWORK="$value" ;;
          --num-workers) NUM_WORKERS="$value" ;;
          --run-dir) RUN_DIR="$value" ;;
          --gin-file) GIN_FILES+=("$value") ;;
          --gin-binding) GIN_BINDINGS+=("$value") ;;
          --env)
            [[ "$value" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env expects KEY=VALUE, got '$value'"
            TRAIN_ENV+=("$value") ;;
          --compile-cache) COMPILE_CACHE="$value" ;;
          --retriever-gin) RETRIEVER_GIN="$value" ;;
          --retriever-index) RETRIEVER_INDEX="$value" ;;
          --retriever-port) RETRIEVER_PORT="$value" ;;
          --retriever-worker) RETRIEVER_WORKER="$value" ;;
          --retriever-url) RETRIEVER_URL="$value" ;;
          --retriever-timeout) RETRIEVER_TIMEOUT="$value" ;;
          --remote-dir) REMOTE_DIR="$value" ;;
          --venv) VENV="$value" ;;
          --jax-version) JAX_VERSION="$value" ;;
          --ssh-flag) SSH_FLAGS+=("$value") ;;
          --log-dir) LOG_DIR="$value" ;;
          --retries) RETRIES="$value" ;;
          --retry-delay) RETRY_DELAY="$value" ;;
          --worker) WORKER="$value" ;;
          --file) LOG_FILE="$value" ;;
          --lines) LINES="$value" ;;
          --poll) POLL="$value" ;;
          --assume-state) ASSUME_STATE="$value" ;;
        esac ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
  done
  finalize_args
}

finalize_args() {
  local n
  for n in RETRIES RETRY_DELAY RETRIEVER_PORT RETRIEVER_WORKER RETRIEVER_TIMEOUT WORKER LINES POLL; do
    [[ "${!n}" =~ ^[0-9]+$ ]] || die "--$(tr '_A-Z' '-a-z' <<<"$n") must be a non-negative integer, got '${!n}'"
  done
  for n in REMOTE_DIR VENV; do
    [[ "${!n}" =~ ^[A-Za-z0-9_][A-Za-z0-9_./-]*$ ]] \
      || die "--$(tr '_A-Z' '-a-z' <<<"$n") must be a plain path relative to the remote home, got '${!n}'"
  done
  (( SPOT && PREEMPTIBLE )) && die "--spot and --preemptible are mutually exclusive"
  if [[ "$ACCELERATOR" =~ ^v5e-([0-9]+)$ ]]; then ACCELERATOR="v5litepod-${BASH_REMATCH[1]}"; fi
  [[ "$ACCELERATOR" =~ ^(v2|v3|v4|v5p|v5litepod|v6e)-[0-9]+$ ]] \
    || die "--accelerator '$ACCELERATOR' not understood; expected e.g. v4-8, v5litepod-8, v5p-8, v6e-8"
  [[ -n "$RUNTIME_VERSION" ]] || RUNTIME_VERSION="$(default_runtime "$ACCELERATOR")"
  [[ -n "$NUM_WORKERS" ]] || NUM_WORKERS="$(num_workers "$ACCELERATOR")"
  [[ "$NUM_WORKERS" =~ ^[1-9][0-9]*$ ]] || die "--num-workers must be a positive integer, got '$NUM_WORKERS'"
  [[ -n "$QR_NAME" ]] || QR_NAME="${NAME:+$NAME-qr}"
  [[ -n "$LOG_DIR" ]] || LOG_DIR="launch_logs/${NAME:-unnamed}"
  if [[ -n "$RUN_DIR" && "$RUN_DIR" != gs://* ]]; then
    die "--run-dir must be a GCS path (gs://bucket/run): every worker and a recreated VM must see it, got '$RUN_DIR'"
  fi
  # Outside the run dir on purpose: --overwrite replaces a run dir whole, and later runs of the same
  # programs (same HLO, jax version and TPU type: the cache key) reuse the entries.
  if [[ -z "$COMPILE_CACHE" && -n "$RUN_DIR" ]]; then
    local bucket="${RUN_DIR#gs://}"
    COMPILE_CACHE="gs://${bucket%%/*}/rexrag_xla_cache"
  fi
  if [[ -n "$COMPILE_CACHE" && "$COMPILE_CACHE" != none && "$COMPILE_CACHE" != gs://?* && "$COMPILE_CACHE" != /?* ]]; then
    die "--compile-cache must be gs://bucket/path, an absolute path on every worker, or 'none', got '$COMPILE_CACHE'"
  fi
  return 0
}

# require VAR...: die naming the first missing flag.
require() {
  local v
  for v in "$@"; do
    [[ -n "${!v}" ]] || die "--$(tr '_A-Z' '-a-z' <<<"$v") is required (see --help)"
  done
}

# ---- accelerator facts ------------------------------------------------------------------------------
default_runtime() {
  case "$1" in
    v2-*|v3-*) echo "tpu-ubuntu2204-base" ;;
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
  esac
}

# Hosts per slice. v2/v3/v4/v5p sizes count TensorCores (8 per host); v5e/v6e sizes count chips:
# up to 8 chips fit one host, larger slices have 4 chips per host.
num_workers() {
  local gen="${1%-*}" size="${1##*-}"
  case "$gen" in
    v2|v3|v4|v5p) echo $(( size <= 8 ? 1 : size / 8 )) ;;
    v5litepod|v6e) echo $(( size <= 8 ? 1 : size / 4 )) ;;
  esac
}

# ---- gcloud pieces ----------------------------------------------------------------------------------
scope_flags() {
  SCOPE=(--zone="$ZONE")
  if [[ -n "$PROJECT" ]]; then SCOPE+=(--project="$PROJECT"); fi
}

# tpu_ssh WORKER REMOTE_CMD: gcloud ssh with retries; WORKER is a number or "all".
tpu_ssh() {
  scope_flags
  retry gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" --worker="$1" "${SSH_FLAGS[@]}" --command="$2"
}

# remote_script NAME ARGS...: the command line that runs launch/remote/NAME on a worker.
remote_script() {
  local script="$1"; shift
  quote_cmd bash "$REMOTE_DIR/launch/remote/$script" "$@"
}

common_remote_args() {
  REMOTE_ARGS=(--venv "$VENV" --remote-dir "$REMOTE_DIR")
}

# ---- steps ------------------------------------------------------------------------------------------
do_create() {
  require NAME ZONE
  scope_flags
  local cap=()
  if (( SPOT )); then cap+=(--spot); fi
  if (( PREEMPTIBLE )); then cap+=(--preemptible); fi
  local net=()
  if [[ -n "$NETWORK" ]]; then net+=(--network="$NETWORK"); fi
  if [[ -n "$SUBNETWORK" ]]; then net+=(--subnetwork="$SUBNETWORK"); fi
  if (( QUEUED )); then
    local extra=()
    if [[ -n "$VALID_UNTIL" ]]; then extra+=(--valid-until-duration="$VALID_UNTIL"); fi
    if (( RESERVED )); then extra+=(--reserved); fi
    retry gcloud compute tpus queued-resources create "$QR_NAME" --node-id="$NAME" "${SCOPE[@]}" \
      --accelerator-type="$ACCELERATOR" --runtime-version="$RUNTIME_VERSION" "${cap[@]}" "${net[@]}" "${extra[@]}"
    wait_active
  else
    if (( RESERVED )); then cap+=(--reserved); fi
    retry gcloud compute tpus tpu-vm create "$NAME" "${SCOPE[@]}" --accelerator-type="$ACCELERATOR" \
      --version="$RUNTIME_VERSION" "${cap[@]}" "${net[@]}"
  fi
}

# tpu_state: sets STATE to READY / ACTIVE when usable, else PREEMPTED / SUSPENDED / FAILED / ... /
# NOT_FOUND. Under --dry-run the describe command is printed and STATE = --assume-state [PREEMPTED].
tpu_state() {
  scope_flags
  local describe
  if (( QUEUED )); then
    describe=(gcloud compute tpus queued-resources describe "$QR_NAME" "${SCOPE[@]}" --format='value(state.state)')
  else
    describe=(gcloud compute tpus tpu-vm describe "$NAME" "${SCOPE[@]}" --format='value(state)')
  fi
  if (( DRY_RUN )); then
    run "${describe[@]}"
    STATE="${ASSUME_STATE:-PREEMPTED}"
    return 0
  fi
  STATE="$("${describe[@]}" 2>/dev/null)" || STATE="NOT_FOUND"
  STATE="${STATE:-NOT_FOUND}"
}

# Wait for a queued resource to become ACTIVE (it may wait for capacity for hours).
wait_active() {
  while true; do
    if (( DRY_RUN )); then ASSUME_STATE=ACTIVE; fi
    tpu_state
    case "$STATE" in
      ACTIVE|READY) log "$QR_NAME is $STATE"; return 0 ;;
      FAILED|SUSPENDED) die "queued resource $QR_NAME is $STATE; see: gcloud compute tpus queued-resources describe $QR_NAME --zone=$ZONE" ;;
    esac
    if (( DRY_RUN )); then return 0; fi
    log "$QR_NAME is ${STATE}; polling again in ${POLL}s"
    sleep "$POLL"
  done
}

do_delete() {
  require NAME ZONE
  scope_flags
  if (( QUEUED )); then
    # --force also deletes the TPU VM the queued resource created.
    retry gcloud compute tpus queued-resources delete "$QR_NAME" "${SCOPE[@]}" --force --quiet
  else
    retry gcloud compute tpus tpu-vm delete "$NAME" "${SCOPE[@]}" --quiet
  fi
}

# Copy the working tree (without VCS, caches, logs) to every worker and build the env there.
do_setup() {
  require NAME ZONE
  scope_flags
  local tarball="$LOG_DIR/rexrag_jax.tgz"
  run mkdir -p "$LOG_DIR"
  run tar -czf "$tarball" -C "$REPO_ROOT" --exclude-vcs --exclude=__pycache__ --exclude='*.egg-info' \
    --exclude=.pytest_cache --exclude=launch_logs --exclude=runs .
  retry gcloud compute tpus tpu-vm scp "$tarball" "$NAME:rexrag_jax.tgz" "${SCOPE[@]}" --worker=all "${SSH_FLAGS[@]}"
  common_remote_args
  local setup_args=("${REMOTE_ARGS[@]}")
  if [[ -n "$JAX_VERSION" ]]; then setup_args+=(--jax-version "$JAX_VERSION"); fi
  # Unpack beside the old tree and swap, so a failed copy never leaves a half-written checkout.
  local unpack="rm -rf $REMOTE_DIR.new && mkdir -p $REMOTE_DIR.new && tar -xzf rexrag_jax.tgz -C $REMOTE_DIR.new"
  unpack+=" && rm -rf $REMOTE_DIR && mv $REMOTE_DIR.new $REMOTE_DIR"
  tpu_ssh all "$unpack && $(remote_script setup_worker.sh "${setup_args[@]}")"
}

# start_train: stop stale TPU holders on every worker, then start the trainer everywhere.
do_start_train() {
  check_train_args
  do_kill
  do_train
}

check_train_args() {
  require NAME ZONE RUN_DIR
  ((${#GIN_FILES[@]})) || die "--gin-file is required (e.g. --gin-file gin/rexrag.gin --gin-file gin/model/qwen2.5-3b.gin)"
}

do_kill() {
  require NAME ZONE
  common_remote_args
  tpu_ssh all "$(remote_script kill_tpu.sh "${REMOTE_ARGS[@]}")"
}

# Copy every worker's ~/rexrag_logs to LOG_DIR/worker<k>/ (one scp per worker: same file names).
do_fetch_logs() {
  require NAME ZONE
  scope_flags
  local w
  for ((w = 0; w < NUM_WORKERS; w++)); do
    run mkdir -p "$LOG_DIR/worker$w"
    retry gcloud compute tpus tpu-vm scp --recurse "$NAME:rexrag_logs" "$LOG_DIR/worker$w" "${SCOPE[@]}" \
      --worker="$w" "${SSH_FLAGS[@]}"
  done
}

# resolve_retriever_url: sets URL to --retriever-url, else to the internal IP of the worker that hosts
# the retriever (a WORKER<k>_IP placeholder under --dry-run, after printing the describe command).
resolve_retriever_url() {
  if [[ -n "$RETRIEVER_URL" ]]; then URL="$RETRIEVER_URL"; return 0; fi
  scope_flags
  local describe=(gcloud compute tpus tpu-vm describe "$NAME" "${SCOPE[@]}"
                  --format="value(networkEndpoints[$RETRIEVER_WORKER].ipAddress)") ip
  if (( DRY_RUN )); then
    run "${describe[@]}"
    ip="WORKER${RETRIEVER_WORKER}_IP"
  else
    ip="$("${describe[@]}")" || die "gcloud describe of $NAME failed"
    [[ -n "$ip" ]] || die "could not read the internal IP of worker $RETRIEVER_WORKER of $NAME"
  fi
  URL="http://$ip:$RETRIEVER_PORT/retrieve"
}

check_retriever_args() {
  require NAME ZONE
  [[ -n "$RETRIEVER_URL" || -n "$RETRIEVER_INDEX" ]] \
    || die "--retriever-index (an index dir on the worker or gs://...) or --retriever-url is required"
}

do_retriever() {
  check_retriever_args
  if [[ -n "$RETRIEVER_URL" ]]; then log "using external retriever $RETRIEVER_URL"; return 0; fi
  common_remote_args
  local args=("${REMOTE_ARGS[@]}" --index-dir "$RETRIEVER_INDEX" --port "$RETRIEVER_PORT"
              --timeout "$RETRIEVER_TIMEOUT")
  if [[ -n "$RETRIEVER_GIN" ]]; then args+=(--gin-file "$RETRIEVER_GIN"); fi
  tpu_ssh "$RETRIEVER_WORKER" "$(remote_script start_retriever.sh "${args[@]}")"
}

do_train() {
  check_train_args
  resolve_retriever_url
  common_remote_args
  local args=("${REMOTE_ARGS[@]}" --run-dir "$RUN_DIR" --retriever-url "$URL") g
  for g in "${GIN_FILES[@]}"; do args+=(--gin-file "$g"); done
  for g in "${GIN_BINDINGS[@]}"; do args+=(--gin-binding "$g"); done
  if [[ -n "$COMPILE_CACHE" && "$COMPILE_CACHE" != none ]]; then
    # every program over 1 s of compile (all the trainer's and the engine's at real shapes); a user --env wins
    args+=(--env "JAX_COMPILATION_CACHE_DIR=$COMPILE_CACHE" --env "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1")
  fi
  for g in "${TRAIN_ENV[@]}"; do args+=(--env "$g"); done
  tpu_ssh all "$(remote_script start_train.sh "${args[@]}")"
}
