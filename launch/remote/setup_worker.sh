#!/usr/bin/env bash
# Runs on each TPU worker: build the virtualenv with jax[tpu] and this package (editable).
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
USAGE='usage: setup_worker.sh [--venv rexrag_venv] [--remote-dir rexrag_jax] [--jax-version V] [--dry-run]'
JAX_VERSION=""
remote_flag() { case "$1" in --jax-version) JAX_VERSION="$2" ;; *) return 1 ;; esac; }
parse_remote_args "$@"
start_remote_log setup

if ! python3 -m venv --help >/dev/null 2>&1; then
  run sudo apt-get update -q
  run sudo apt-get install -y -q python3-venv
fi
if [[ ! -x "$VENV_BIN/python" ]]; then run python3 -m venv "$HOME/$VENV"; fi
run "$VENV_BIN/pip" install -q -U pip
run "$VENV_BIN/pip" install -q "jax[tpu]${JAX_VERSION:+==$JAX_VERSION}" \
  -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
run "$VENV_BIN/pip" install -q -e "$CODE"
run "$VENV_BIN/python" -c 'import jax; print("local TPU devices:", jax.local_device_count(), jax.local_devices()[0].device_kind)'
