#!/usr/bin/env bash
# Runs on a worker: print the trainer state as the last line: RUNNING, DONE, DEAD rc=N, or NOT_STARTED.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
USAGE='usage: status.sh [--dry-run]'
remote_flag() { return 1; }
parse_remote_args "$@"
if (( DRY_RUN )); then
  run cat "$LOGS/train.pid" "$LOGS/train.rc"
  exit 0
fi
if pid_alive "$LOGS/train.pid"; then
  echo RUNNING
elif [[ -f "$LOGS/train.rc" ]]; then
  rc="$(cat "$LOGS/train.rc")"
  if [[ "$rc" == 0 ]]; then echo DONE; else echo "DEAD rc=$rc"; fi
elif [[ -f "$LOGS/train.pid" ]]; then
  echo "DEAD rc=unknown"
else
  echo NOT_STARTED
fi
