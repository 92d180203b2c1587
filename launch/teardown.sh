#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
USAGE='usage: launch/teardown.sh --name NAME --zone ZONE [--queued] [--fetch] [--yes] [--dry-run]

Delete the TPU VM (or, with --queued, the queued resource and its VM). --fetch first copies every
worker'"'"'s ~/rexrag_logs into LOG_DIR/worker<k>/. Asks for confirmation unless --yes.'
parse_args "$@"
require NAME ZONE
start_log teardown
if (( FETCH )); then do_fetch_logs; fi
if (( ! YES && ! DRY_RUN )); then
  read -r -p "Delete TPU $NAME in $ZONE? [y/N] " answer
  [[ "$answer" == [yY]* ]] || die "not deleted"
fi
do_delete
