#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
USAGE='usage: launch/create.sh --name NAME --zone ZONE [--accelerator v5litepod-8] [--spot|--preemptible]
                        [--queued [--valid-until 6h] [--reserved]] [--dry-run]

Create a TPU VM (gcloud compute tpus tpu-vm create), or with --queued a queued resource
(gcloud compute tpus queued-resources create) and wait until it is ACTIVE.'
parse_args "$@"
start_log create
do_create
