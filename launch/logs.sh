#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
USAGE='usage: launch/logs.sh --name NAME --zone ZONE [--worker K] [--file train|retriever|setup|kill]
                      [--lines 200] [--no-follow] [--fetch] [--dry-run]

Tail ~/rexrag_logs/FILE.log on worker K (follows by default), or with --fetch copy every worker'"'"'s
~/rexrag_logs into LOG_DIR/worker<k>/.'
parse_args "$@"
require NAME ZONE
[[ "$LOG_FILE" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--file must be a plain log name such as train, got '$LOG_FILE'"
if (( FETCH )); then
  do_fetch_logs
else
  tail_flags=(-n "$LINES")
  if (( FOLLOW )); then tail_flags+=(-F); fi
  tpu_ssh "$WORKER" "$(quote_cmd tail "${tail_flags[@]}" "rexrag_logs/$LOG_FILE.log")"
fi
