#!/usr/bin/env bash
# Runs on the worker that hosts the retriever: start `rexrag serve-retriever` in the background on the
# CPU (JAX_PLATFORMS=cpu so it never takes the TPU from the trainer) and wait until POST /retrieve answers.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
USAGE='usage: start_retriever.sh --gin-file F [--port 8000] [--timeout 1800] [--dry-run]'
PORT=8000
GIN_FILE=""
TIMEOUT=1800
remote_flag() {
  case "$1" in
    --port) PORT="$2" ;;
    --gin-file) GIN_FILE="$2" ;;
    --timeout) TIMEOUT="$2" ;;
    *) return 1 ;;
  esac
}
parse_remote_args "$@"
[[ -n "$GIN_FILE" ]] || die "--gin-file is required"
start_remote_log retriever-start

probe='{"queries": ["health check"], "topk": 1, "return_scores": false}'
answers() { curl -sf -m 10 -X POST -H 'Content-Type: application/json' -d "$probe" "http://127.0.0.1:$PORT/retrieve" >/dev/null; }

if (( ! DRY_RUN )) && pid_alive "$LOGS/retriever.pid" && answers; then
  log "retriever already answers on port $PORT"
  exit 0
fi
if (( ! DRY_RUN )) && pid_alive "$LOGS/retriever.pid"; then run kill "$(cat "$LOGS/retriever.pid")"; fi
run mkdir -p "$LOGS"
cmd=(env JAX_PLATFORMS=cpu "$VENV_BIN/rexrag" serve-retriever --gin_file "$CODE/$GIN_FILE" --host 0.0.0.0
     --port "$PORT")
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
