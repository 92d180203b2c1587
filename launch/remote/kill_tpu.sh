#!/usr/bin/env bash
# Runs on each TPU worker: stop our trainer and anything else still holding the TPU (a crashed or
# preempted run leaves processes that keep /dev/accel* / /dev/vfio open, and the next jax init fails with
# "TPU in use"). The retriever runs with JAX_PLATFORMS=cpu, holds no TPU device and is left alone.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
USAGE='usage: kill_tpu.sh [--dry-run]'
remote_flag() { return 1; }
parse_remote_args "$@"
start_remote_log kill

if (( DRY_RUN )) || pid_alive "$LOGS/train.pid"; then
  run bash -c "kill -9 \$(cat $(quote "$LOGS/train.pid")) 2>/dev/null || true"
fi
run bash -c 'sudo lsof -t /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | sort -u | xargs -r sudo kill -9 || true'
run sudo rm -f /tmp/libtpu_lockfile
