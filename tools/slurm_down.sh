#!/usr/bin/env bash
# Stop the local Slurm cluster started by tools/slurm_up.sh.
#   bash tools/slurm_down.sh [--state DIR] [--wipe]
#     --state DIR  the state directory given to slurm_up.sh (default /var/tmp/hpcrl-slurm)
#     --wipe       also delete DIR (configs, logs, spools, the accounting database) and the
#                  /etc/slurm links into it; the next slurm_up.sh starts job ids at 1 again
# Cancels all jobs first (a stopped slurmd leaves its jobs running), then stops exactly the
# daemons slurm_up.sh started, by their pid files: slurmd's, slurmctld, slurmdbd, MariaDB, munged.
# Idempotent: with nothing running it only reports so.
set -euo pipefail
STATE=/var/tmp/hpcrl-slurm WIPE=0
while [ $# -gt 0 ]; do
  case $1 in
    --state) STATE=$2; shift 2 ;;
    --wipe) WIPE=1; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "slurm_down: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "slurm_down: must run as root" >&2; exit 1; }
STATE=$(realpath -m "$STATE")
T0=$(date +%s)
log() { echo "[slurm_down] $*"; }
RUN=$STATE/run

# running PID COMM: PID is a live (not zombie) process named COMM (a regex); alive PIDFILE COMM: the
# pid file names one. The name check keeps a stale pid file from an earlier boot harmless.
running() { grep -Eqx "$2" "/proc/$1/comm" 2>/dev/null && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
alive() { local pid; pid=$(cat "$1" 2>/dev/null) || return 1; [[ $pid =~ ^[0-9]+$ ]] && running "$pid" "$2"; }
stop() {  # stop PIDFILE COMM NAME: TERM, wait up to 30 s, then KILL. Waits on the pid, not the pid
  # file: the daemons delete their pid file when shutdown begins, seconds before they exit.
  local pid; alive "$1" "$2" || { rm -f "$1"; return 0; }; pid=$(cat "$1")
  kill "$pid"
  for _ in $(seq 300); do running "$pid" "$2" || break; sleep 0.1; done
  if running "$pid" "$2"; then log "$3 ($pid) ignored SIGTERM for 30 s: SIGKILL"; kill -9 "$pid"; sleep 0.5; fi
  rm -f "$1"; log "stopped $3 ($pid)"
}

# 1. Cancel every job while slurmctld still answers, and wait until the queue is empty (jobs
#    in COMPLETING stay listed until their processes are gone; KillWait is 5 s).
if alive "$RUN/slurmctld.pid" slurmctld && command -v squeue >/dev/null; then
  jobs=$(squeue -h -o %i 2>/dev/null | sort -u | tr '\n' ' ' || true)
  if [ -n "${jobs// }" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    end=$(( $(date +%s) + 60 ))
    while [ -n "$(squeue -h -o %i 2>/dev/null || true)" ]; do
      if [ "$(date +%s)" -ge "$end" ]; then
        log "WARNING: jobs still queued after 60 s:"; squeue 2>&1 || true; break
      fi
      sleep 0.5
    done
  fi
  # A job leaves squeue a moment before its slurmstepd has finished tearing down: let it.
  end=$(( $(date +%s) + 15 ))
  while pgrep -x slurmstepd >/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
fi

# 2. Stop the daemons, consumers before the services they use.
for f in "$RUN"/slurmd-*.pid; do
  [ -e "$f" ] && stop "$f" slurmd "$(basename "$f" .pid)"
done
stop "$RUN/slurmctld.pid" slurmctld slurmctld
stop "$RUN/slurmdbd.pid" slurmdbd slurmdbd
stop "$STATE/mysql/mysqld.pid" 'mariadbd|mysqld' mariadbd   # SIGTERM is a clean shutdown
stop "$STATE/munge/munged.pid" munged munged

# Job steps outlive slurmd; after the cancel above there should be none. Report, do not guess.
left=$(pgrep -x slurmstepd || true)
[ -z "$left" ] || log "WARNING: slurmstepd processes still running: ${left//$'\n'/ } (kill them by pid)"

if [ "$WIPE" = 1 ]; then
  case $STATE in /|/var|/var/tmp|/tmp|/root|/home|/etc|/usr) echo "slurm_down: refusing to wipe $STATE" >&2; exit 1 ;; esac
  for f in slurm.conf gres.conf slurmdbd.conf; do   # links slurm_up.sh made into this state dir
    [ "$(readlink /etc/slurm/$f 2>/dev/null)" = "$STATE/etc/$f" ] && rm -f /etc/slurm/$f
  done
  rm -rf "$STATE"
  log "wiped $STATE"
fi
log "done in $(( $(date +%s) - T0 ))s"
