# shellcheck shell=bash disable=SC2034  # variables here are read by the scripts that source this file
# Shared by launch/remote/*.sh, which run ON a TPU worker (copied there by launch/setup.sh).
# Flags: --venv D --remote-dir D (relative to $HOME) --dry-run, plus script flags handled by the caller
# through the `remote_flag` hook.

set -euo pipefail

VENV="rexrag_venv"
REMOTE_DIR="rexrag_jax"
DRY_RUN=0
LOGS="$HOME/rexrag_logs"

log() { printf '[%s %s] %s\n' "$(hostname)" "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

quote() {
  local s="$1"
  if [[ -n "$s" && "$s" =~ ^[A-Za-z0-9_./:=,@%+^-]+$ ]]; then printf '%s' "$s"; else printf "'%s'" "${s//\'/\'\\\'\'}"; fi
}
quote_cmd() {
  local out="" a
  for a in "$@"; do out+="${out:+ }$(quote "$a")"; done
  printf '%s' "$out"
}

# run CMD...: print under --dry-run, else log and run.
run() {
  if (( DRY_RUN )); then printf '%s\n' "$(quote_cmd "$@")"; return 0; fi
  log "+ $(quote_cmd "$@")"
  "$@"
}

# parse_remote_args "$@": common flags here; anything else goes to the script's remote_flag FLAG VALUE
# (which must exist in the script and return 1 for unknown flags).
parse_remote_args() {
  while (($#)); do
    case "$1" in
      -h|--help) printf '%s\n' "$USAGE"; exit 0 ;;
      --dry-run) DRY_RUN=1; shift ;;
      --*)
        # A following flag is never a value (so a missing value cannot swallow --dry-run).
        if (($# < 2)) || [[ "$2" == --* ]]; then die "$1 needs a value"; fi
        case "$1" in
          --venv) VENV="$2" ;;
          --remote-dir) REMOTE_DIR="$2" ;;
          *) remote_flag "$1" "$2" || die "unknown argument '$1'" ;;
        esac
        shift 2 ;;
      *) die "unknown argument '$1'" ;;
    esac
  done
  VENV_BIN="$HOME/$VENV/bin"
  CODE="$HOME/$REMOTE_DIR"
}

# Mirror output into $LOGS/NAME.log on this worker (not under --dry-run).
start_remote_log() {
  if (( DRY_RUN )); then return 0; fi
  mkdir -p "$LOGS"
  exec > >(tee -a "$LOGS/$1.log") 2> >(tee -a "$LOGS/$1.log" >&2)
}

# pid_alive FILE: the process whose id is in FILE is running.
pid_alive() {
  [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}
