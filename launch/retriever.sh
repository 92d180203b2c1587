#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck disable=SC2016  # literal backticks in help text
USAGE='usage: launch/retriever.sh --name NAME --zone ZONE --retriever-index DIR|gs://... [--retriever-gin F]
                           [--retriever-port 8000] [--retriever-worker 0] [--dry-run]

Start `rexrag serve-retriever` (CPU only, JAX_PLATFORMS=cpu) on one worker and wait until POST /retrieve
answers. Does nothing when it already answers, or when --retriever-url points at an external server.'
parse_args "$@"
start_log retriever
do_retriever
