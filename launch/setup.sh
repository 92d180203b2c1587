#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
USAGE='usage: launch/setup.sh --name NAME --zone ZONE [--jax-version V] [--dry-run]

Copy this working tree to every worker (scp --worker=all), unpack it atomically into ~/REMOTE_DIR and
build the virtualenv there (jax[tpu] + pip install -e .). Each worker logs to ~/rexrag_logs/setup.log.'
parse_args "$@"
start_log setup
do_setup
