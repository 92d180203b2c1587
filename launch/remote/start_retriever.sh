#!/usr/bin/env bash
# Runs on the worker that hosts the retriever: start `rexrag serve-retriever` in the background on the
# CPU (JAX_PLATFORMS=cpu so it never takes the TPU from the trainer) and wait until POST /retrieve answers.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
USAGE='usage: start_retriever.sh --index-dir DIR|gs://... [--gin-file F] [--port 8000] [--timeout 1800] [--dry-run]'
PORT=8000
GIN_FILE=""
INDEX=""
TIMEOUT=1800
remote_flag() {
  case "$1" in
    --port) PORT="$2" ;;
    --gin-file) GIN_FILE="$2" ;;
    --index-dir) INDEX="$2" ;;
    --timeout) TIMEOUT="$2" ;;
    *) return 1 ;;
  esac
}
parse_remote_args "$@"
[[ -n "$INDEX" ]] || die "--index-dir is required"
start_remote_log retriever-start

probe='{"queries": ["health check"], "topk": 1, "return_scores": false}'
answers() { curl -sf -m 10 -X POST -H 'Content-Type: application/json' -d "$probe" "http://127.0.0.1:$PORT/retrieve" >/dev/null; }

if (( ! DRY_RUN )) && pid_alive "$LOGS/retriever.pid" && answers; then
  log "retriever already answers on port $PORT"
  exit 0
fi
if (( ! DRY_RUN )) && pid_alive "$LOGS/retriever.pid"; then run kill "$(cat "$LOGS/retriever.pid")"; fi
run mkdir -p "$LOGS"
if [[ "$INDEX" == gs://* ]]; then
  # Index files are read many times at start-up: copy them to the local disk once (rsync is incremental).
  run mkdir -p "$HOME/rexrag_index"
  run gcloud storage rsync -r "$INDEX" "$HOME/rexrag_index"
  INDEX="$HOME/rexrag_index"
fi
cmd=(env JAX_PLATFORMS=cpu "$VENV_BIN/rexrag" serve-retriever --index_dir "$INDEX" --host 0.0.0.0 --port "$PORT")
if [[ -n "$GIN_FILE" ]]; then cmd+=(--gin_file "$CODE/$GIN_FILE"); fi
if (( DRY_RUN )); then
  run "${cmd[@]}"
  exit 0
fi
log "+ $(quote_cmd "${cmd[@]}")"
nohup "${cmd[@]}" >"$LOGS/retriever.log" 2>&1 </dev/null &
echo $! >"$LOGS/retriever.pid"

deadline=$((SECONDS + TIMEOUT))
until answers; do
  if ! pid_alive "$LOGS/retriever.pid"; then
    tail -n 50 "$LOGS/retriever.log" >&2
    die "retriever exited before answering; log: $LOGS/retriever.log"
  fi
  ((SECONDS < deadline)) || die "retriever did not answer on port $PORT within ${TIMEOUT}s; log: $LOGS/retriever.log"
  sleep 10
done
log "retriever answers on port $PORT"
