#!/usr/bin/env bash
# Runs on every TPU worker at once: start `rexrag train` in the background. All workers run the same
# command; jax.distributed discovers the slice from the TPU metadata. The run dir and retriever URL reach
# the trainer as gin macros (RUN_DIR, RETRIEVER_URL) and environment variables (REXRAG_RUN_DIR,
# REXRAG_RETRIEVER_URL); the trainer resumes from the latest checkpoint in the run dir.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
USAGE='usage: start_train.sh --run-dir gs://B/RUN --retriever-url URL --gin-file F [--gin-file F ...]
                      [--gin-binding B ...] [--env KEY=VALUE ...] [--dry-run]'
RUN_DIR=""
URL=""
GIN_FILES=()
GIN_BINDINGS=()
EXTRA_ENV=()
remote_flag() {
  case "$1" in
    --run-dir) RUN_DIR="$2" ;;
    --retriever-url) URL="$2" ;;
    --gin-file) GIN_FILES+=("$2") ;;
    --gin-binding) GIN_BINDINGS+=("$2") ;;
    --env) [[ "$2" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env expects KEY=VALUE, got '$2'"; EXTRA_ENV+=("$2") ;;
    *) return 1 ;;
  esac
}
parse_remote_args "$@"
[[ -n "$RUN_DIR" ]] || die "--run-dir is required"
[[ -n "$URL" ]] || die "--retriever-url is required"
((${#GIN_FILES[@]})) || die "at least one --gin-file is required"

cmd=(env "REXRAG_RUN_DIR=$RUN_DIR" "REXRAG_RETRIEVER_URL=$URL" "${EXTRA_ENV[@]}" "$VENV_BIN/rexrag" train)
for f in "${GIN_FILES[@]}"; do cmd+=(--gin_file "$f"); done
for b in "${GIN_BINDINGS[@]}"; do cmd+=(--gin_bindings "$b"); done
cmd+=(--gin_bindings "RUN_DIR = '$RUN_DIR'" --gin_bindings "RETRIEVER_URL = '$URL'")

if (( DRY_RUN )); then
  run cd "$CODE"
  run "${cmd[@]}"
  exit 0
fi
mkdir -p "$LOGS"
cd "$CODE"
rm -f "$LOGS/train.rc"
log "+ $(quote_cmd "${cmd[@]}")"
# The wrapper records the exit status so status.sh can tell "finished" from "died".
# shellcheck disable=SC2016  # expanded by the inner bash
nohup bash -c '"$@"; echo $? > "$0"' "$LOGS/train.rc" "${cmd[@]}" >>"$LOGS/train.log" 2>&1 </dev/null &
echo $! >"$LOGS/train.pid"
log "trainer started (pid $(cat "$LOGS/train.pid")); log: $LOGS/train.log"
