#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck disable=SC2016  # literal backticks in help text
USAGE='usage: launch/train.sh --name NAME --zone ZONE --run-dir gs://BUCKET/RUN --gin-file F [--gin-file F ...]
                       [--gin-binding B ...] [--retriever-url URL] [--dry-run]

Kill stale TPU processes on every worker, then start `rexrag train` on all workers (--worker=all) in the
background. The trainer resumes from the latest checkpoint in --run-dir when there is one.'
parse_args "$@"
start_log train
do_start_train
