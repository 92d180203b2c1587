#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
USAGE='usage: launch/resume.sh --name NAME --zone ZONE --run-dir gs://BUCKET/RUN --gin-file F ...
                        --retriever-index gs://BUCKET/INDEX
                        [--watch [--poll 300]] [--assume-state STATE] [--dry-run]

Bring a run back after preemption. If the TPU (or queued resource) is not READY/ACTIVE it is deleted and
recreated, code and env are set up again and the retriever restarted; then the trainer is restarted on
all workers and resumes from the latest checkpoint in --run-dir. With --watch, keep polling every --poll
seconds: recover after preemption, restart a trainer that died, stop when the trainer finished.
Under --dry-run the state query is printed and the state is taken from --assume-state [PREEMPTED].'
parse_args "$@"
check_train_args
check_retriever_args
start_log resume

recover() {
  tpu_state
  case "$STATE" in
    READY|ACTIVE)
      log "$NAME is $STATE: restarting the trainer"
      do_retriever
      do_start_train ;;
    *)
      log "$NAME is $STATE: recreating it"
      if [[ "$STATE" != NOT_FOUND ]]; then do_delete; fi
      do_create
      do_setup
      do_retriever
      do_start_train ;;
  esac
}

if (( ! WATCH )); then
  recover
  exit 0
fi

while true; do
  tpu_state
  if [[ "$STATE" != READY && "$STATE" != ACTIVE ]]; then
    recover
  else
    common_remote_args
    trainer="$(tpu_ssh 0 "$(remote_script status.sh "${REMOTE_ARGS[@]}")" | tail -n 1)" || trainer="UNKNOWN"
    case "$trainer" in
      RUNNING*) log "trainer running" ;;
      DONE*) log "trainer finished"; exit 0 ;;
      *) log "trainer state '$trainer': restarting it"; recover ;;
    esac
  fi
  if (( DRY_RUN )); then exit 0; fi
  sleep "$POLL"
done
