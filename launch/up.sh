#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
USAGE='usage: launch/up.sh --name NAME --zone ZONE --run-dir gs://BUCKET/RUN --gin-file F ...
                    --retriever-index gs://BUCKET/INDEX [--dry-run]

Everything in order: create the TPU (VM or --queued), copy code and set up every worker, start the
retriever, start the trainer.'
parse_args "$@"
check_train_args
check_retriever_args
start_log up
do_create
do_setup
do_retriever
do_start_train
