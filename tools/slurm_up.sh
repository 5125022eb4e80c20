#!/usr/bin/env bash
# Start a local Slurm cluster (Debian 12, slurm 22.05) on this one machine, as root, without an
# init system: munged, MariaDB, slurmdbd, slurmctld and N slurmd daemons posing as nodes n1..nN.
#   bash tools/slurm_up.sh [--nodes N] [--gpus G] [--cpus C] [--state DIR] [--wipe]
#     --nodes N   fake nodes n1..nN, one slurmd each (default 1)
#     --gpus G    fake GPUs per node, gres "gpu" on mknod'ed devices (default 0)
#     --cpus C    CPUs per node (default: nproc)
#     --state DIR configs, logs, pid files, spools, MariaDB data (default /var/tmp/hpcrl-slurm)
#     --wipe      stop everything and delete DIR first (job ids restart at 1)
# Idempotent: a second run with the same shape returns in seconds; another shape restarts
# slurmctld and the slurmd daemons with the new config. Partitions: debug (default), cpu, gpu,
# all over the same nodes. Config is linked at /etc/slurm/ so sbatch/srun/submitit need no env.
# Stop with tools/slurm_down.sh [--state DIR] [--wipe].
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NODES=1 GPUS=0 CPUS=$(nproc) STATE=/var/tmp/hpcrl-slurm WIPE=0
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) NODES=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --cpus) CPUS=$2; shift 2 ;;
    --state) STATE=$2; shift 2 ;;
    --wipe) WIPE=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "slurm_up: unknown option $1" >&2; exit 2 ;;
  esac
done
for v in "$NODES" "$GPUS" "$CPUS"; do [[ $v =~ ^[0-9]+$ ]] || { echo "slurm_up: not a number: $v" >&2; exit 2; }; done
[ "$NODES" -ge 1 ] && [ "$CPUS" -ge 1 ] || { echo "slurm_up: need --nodes >= 1 and --cpus >= 1" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "slurm_up: must run as root" >&2; exit 1; }
STATE=$(realpath -m "$STATE")
T0=$(date +%s)
log() { echo "[slurm_up] $*"; }

CLUSTER=hpcrl
CTLD_PORT=6817 DBD_PORT=6819 DB_PORT=16306 NODE_PORT0=17000   # slurmd of nK listens on 17000+K
ETC=$STATE/etc LOGS=$STATE/log RUN=$STATE/run SPOOL=$STATE/spool
MUNGE=$STATE/munge MYSQL=$STATE/mysql

[ "$WIPE" = 0 ] || bash "$HERE/slurm_down.sh" --state "$STATE" --wipe

# --- packages (only what is missing); policy-rc.d keeps the packages' services from starting ---
PKGS=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  made_policy=0   # policy-rc.d exiting 101 = "do not start services"; ours only if none exists
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; made_policy=1; }
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$made_policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
fi

# --- helpers ---
# running PID COMM: PID is a live (not zombie) process named COMM (a regex); alive PIDFILE COMM: the
# pid file names one. The name check keeps a stale pid file from an earlier boot harmless.
running() { grep -Eqx "$2" "/proc/$1/comm" 2>/dev/null && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
alive() { local pid; pid=$(cat "$1" 2>/dev/null) || return 1; [[ $pid =~ ^[0-9]+$ ]] && running "$pid" "$2"; }
stop() {  # stop PIDFILE COMM: TERM, wait up to 30 s, then KILL. Waits on the pid, not the pid
  # file: the daemons delete their pid file when shutdown begins, seconds before they exit.
  local pid; alive "$1" "$2" || { rm -f "$1"; return 0; }; pid=$(cat "$1"); kill "$pid"
  for _ in $(seq 300); do running "$pid" "$2" || break; sleep 0.1; done
  running "$pid" "$2" && kill -9 "$pid"; rm -f "$1"
}
fail() {  # fail MESSAGE LOGFILE...: print the message and the tails of the logs, exit 1
  echo "[slurm_up] ERROR: $1" >&2; shift
  for f in "$@"; do [ -f "$f" ] && { echo "--- tail $f" >&2; tail -n 25 "$f" >&2; }; done
  exit 1
}
waitfor() {  # waitfor SECONDS COMMAND...: retry every 0.2 s until COMMAND succeeds
  local end=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 0.2; done
}

# --- host name: slurm resolves SlurmctldHost/NodeHostname; everything talks over 127.0.0.1 ---
HOST=$(hostname -s)
getent hosts "$HOST" >/dev/null || { echo "127.0.0.1 $HOST" >>/etc/hosts; log "added $HOST to /etc/hosts"; }
# Jobs see their nodes by NodeName (SLURM_JOB_NODELIST=n[1-2]); multi-node jobs rendezvous on the
# first one (MASTER_ADDR=n1), so the fake node names must resolve too.
for k in $(seq 1 "$NODES"); do
  getent hosts "n$k" >/dev/null || { echo "127.0.0.1 n$k" >>/etc/hosts; log "added n$k to /etc/hosts"; }
done
# One cluster per host (ports are fixed): refuse if /etc/slurm points at another, running state dir.
other=$(readlink /etc/slurm/slurm.conf 2>/dev/null || true)
if [ -n "$other" ] && [ "$other" != "$ETC/slurm.conf" ] && \
   alive "$(dirname "$(dirname "$other")")/run/slurmctld.pid" slurmctld; then
  echo "slurm_up: a cluster from $(dirname "$(dirname "$other")") is running; stop it first" >&2; exit 1
fi

# --- state directory ---
install -d -m 755 "$STATE" "$ETC" "$LOGS" "$RUN" "$SPOOL" "$SPOOL/ctld" "$STATE/dev"
install -d -o munge -g munge -m 700 "$MUNGE"
install -d -o munge -g munge -m 755 /run/munge          # munged's socket, where slurm looks for it
install -d -o mysql -g mysql -m 750 "$MYSQL"
[ -s "$MUNGE/munge.key" ] || dd if=/dev/urandom of="$MUNGE/munge.key" bs=1024 count=1 status=none
chown munge:munge "$MUNGE/munge.key" && chmod 400 "$MUNGE/munge.key"   # munged refuses anything looser
[ -s "$ETC/dbpass" ] || (umask 077; od -An -N12 -tx1 /dev/urandom | tr -d ' \n' >"$ETC/dbpass")
DBPASS=$(cat "$ETC/dbpass")
# Fake GPUs: character devices (same numbers as /dev/null); slurm only needs File= to exist and
# sets CUDA_VISIBLE_DEVICES from the index of the allocated ones.
for k in $(seq "$NODES"); do
  install -d -m 755 "$STATE/dev/n$k" "$SPOOL/slurmd-n$k"
  for ((g = 0; g < GPUS; g++)); do [ -c "$STATE/dev/n$k/nvidia$g" ] || mknod -m 666 "$STATE/dev/n$k/nvidia$g" c 1 3; done
done

# --- configs: written to *.new, moved in place only when they differ (that decides restarts) ---
MEM_MB=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 ))
RESERVE_MB=$(( MEM_MB / 10 > 1024 ? MEM_MB / 10 : 1024 ))      # left to the OS and the daemons
NODE_MEM=$(( (MEM_MB - RESERVE_MB) / NODES ))
DEF_MEM=$(( NODE_MEM / CPUS ))     # DefMemPerCPU: without it a job takes a whole node's memory
NODELIST=n1; [ "$NODES" -gt 1 ] && NODELIST="n[1-$NODES]"
GRES=""; [ "$GPUS" -gt 0 ] && GRES=" Gres=gpu:$GPUS"
{
  cat <<EOF
# Written by tools/slurm_up.sh: nodes=$NODES gpus=$GPUS cpus=$CPUS state=$STATE
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Short credential lifetime: a requeued job restarts in ~11 s instead of ~121 s.
AuthInfo=cred_expire=10
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/slurmd-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
# Nodes are fake (several per host, CPUs/memory as configured, not as detected).
SlurmdParameters=config_overrides
# No cgroups in this container: track processes by pid, no task binding. Hence no cgroup.conf, and
# no PrologFlags (Contain needs proctrack/cgroup); no RebootProgram either.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Cores and memory as consumable resources, so that several jobs share a node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$DEF_MEM
# Schedule every second; kill jobs whose dependency can never be met instead of pending forever.
SchedulerParameters=sched_interval=1,bf_interval=1,kill_invalid_depend
# A node that was DOWN (e.g. slurmd restarted) returns to service when it registers.
ReturnToService=2
KillWait=5
# Finished jobs leave slurmctld's memory after 30 s; sacct (slurmdbd) keeps them for good.
MinJobAge=30
JobRequeue=1
# No MTA here: slurmctld logs an error for the default MailProg.
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
GresTypes=gpu
EOF
  for k in $(seq "$NODES"); do
    echo "NodeName=n$k NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((NODE_PORT0 + k)) CPUs=$CPUS" \
         "Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$NODE_MEM$GRES State=UNKNOWN"
  done
  for part in debug cpu gpu; do
    dflt=NO; [ $part = debug ] && dflt=YES
    echo "PartitionName=$part Nodes=$NODELIST Default=$dflt MaxTime=INFINITE State=UP"
  done
} >"$ETC/slurm.conf.new"
echo "# Written by tools/slurm_up.sh" >"$ETC/gres.conf.new"
for k in $(seq "$NODES"); do   # one line per node: each node's own device files
  [ "$GPUS" = 0 ] || echo "NodeName=n$k Name=gpu File=$STATE/dev/n$k/nvidia[0-$((GPUS - 1))]" >>"$ETC/gres.conf.new"
done
(umask 077; cat >"$ETC/slurmdbd.conf.new" <<EOF
# Written by tools/slurm_up.sh (mode 600: it holds the database password)
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
# TCP to our own MariaDB (host "localhost" would use the client library's default socket path).
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
EOF
)
changed=()
for f in slurm.conf gres.conf slurmdbd.conf; do
  if cmp -s "$ETC/$f.new" "$ETC/$f"; then rm -f "$ETC/$f.new"; else mv "$ETC/$f.new" "$ETC/$f"; changed+=("$f"); fi
done
chmod 600 "$ETC/slurmdbd.conf"
# Link the configs at slurm's default location: clients (sbatch, srun, sacct, submitit) find them.
install -d -m 755 /etc/slurm
for f in slurm.conf gres.conf slurmdbd.conf; do
  if [ -e /etc/slurm/$f ] && [ ! -L /etc/slurm/$f ]; then mv /etc/slurm/$f /etc/slurm/$f.hpcrl-bak; fi
  ln -sfn "$ETC/$f" /etc/slurm/$f
done

# --- munged, as user munge ---
if ! alive "$MUNGE/munged.pid" munged; then
  runuser -u munge -- munged --key-file="$MUNGE/munge.key" --log-file="$MUNGE/munged.log" \
    --pid-file="$MUNGE/munged.pid" --seed-file="$MUNGE/munged.seed" || fail "munged did not start" "$MUNGE/munged.log"
  waitfor 10 bash -c 'munge -n | unmunge' || fail "munge does not answer" "$MUNGE/munged.log"
fi

# --- MariaDB: data, socket, pid and log under $MYSQL; TCP on 127.0.0.1 only ---
MYSQLD=$(command -v mariadbd || command -v mysqld)
SQL=(mariadb --no-defaults --socket="$MYSQL/mysqld.sock" -u root)
if [ ! -d "$MYSQL/data/mysql" ]; then
  mariadb-install-db --no-defaults --user=mysql --datadir="$MYSQL/data" --skip-test-db \
    --auth-root-authentication-method=socket >"$LOGS/mariadb-install.log" 2>&1 \
    || fail "mariadb-install-db failed" "$LOGS/mariadb-install.log"
fi
if ! alive "$MYSQL/mysqld.pid" 'mariadbd|mysqld'; then
  # --no-defaults: ignore /etc/mysql (datadir /var/lib/mysql, socket /run/mysqld). The buffer pool
  # and lock wait are slurmdbd's minimums (it logs an error below them); the pool is lazily filled.
  setsid "$MYSQLD" --no-defaults --user=mysql --datadir="$MYSQL/data" --socket="$MYSQL/mysqld.sock" \
    --pid-file="$MYSQL/mysqld.pid" --log-error="$MYSQL/mysqld.log" --bind-address=127.0.0.1 \
    --port=$DB_PORT --skip-name-resolve --skip-log-bin --innodb-buffer-pool-size=512M \
    --innodb-lock-wait-timeout=900 --performance-schema=OFF </dev/null >/dev/null 2>&1 &
  waitfor 60 "${SQL[@]}" -e 'select 1' || fail "MariaDB does not answer" "$MYSQL/mysqld.log"
  waitfor 10 test -s "$MYSQL/mysqld.pid" || true
fi
"${SQL[@]}" <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF

# --- slurmdbd, then the cluster, account and user in the accounting database ---
[[ " ${changed[*]} " == *" slurmdbd.conf "* ]] && stop "$RUN/slurmdbd.pid" slurmdbd
alive "$RUN/slurmdbd.pid" slurmdbd || slurmdbd || fail "slurmdbd did not start" "$LOGS/slurmdbd.log"
waitfor 60 sacctmgr -n show cluster || fail "slurmdbd does not answer" "$LOGS/slurmdbd.log" "$MYSQL/mysqld.log"
sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
sacctmgr -n -P show account "$CLUSTER" format=account | grep -qx "$CLUSTER" || \
  sacctmgr -i add account "$CLUSTER" Description="hpcrl jobs" Organization=hpcrl >/dev/null
sacctmgr -n -P show assoc where user=root account="$CLUSTER" format=user | grep -qx root || \
  sacctmgr -i add user root Account="$CLUSTER" >/dev/null

# --- slurmctld and the slurmd of every node; a new shape restarts them all ---
if [[ " ${changed[*]} " == *" slurm.conf "* || " ${changed[*]} " == *" gres.conf "* ]]; then
  for f in "$RUN"/slurmd-*.pid; do [ -e "$f" ] && stop "$f" slurmd; done
  stop "$RUN/slurmctld.pid" slurmctld
fi
for f in "$RUN"/slurmd-*.pid; do   # slurmd of nodes this shape no longer has
  n=$(basename "$f" .pid); n=${n#slurmd-}
  [ -e "$f" ] && { [[ $n =~ ^n[0-9]+$ ]] && [ "${n#n}" -le "$NODES" ] || stop "$f" slurmd; }
done
alive "$RUN/slurmctld.pid" slurmctld || slurmctld || fail "slurmctld did not start" "$LOGS/slurmctld.log"
for k in $(seq "$NODES"); do
  alive "$RUN/slurmd-n$k.pid" slurmd || slurmd -N "n$k" || fail "slurmd n$k did not start" "$LOGS/slurmd-n$k.log"
done

# --- ready: every node up (idle on a fresh start; mix/alloc/comp when a re-run finds jobs), sacct answers ---
all_up() {  # a '*' suffix means not responding; down, drain, unk etc. are not up either
  [ "$(sinfo -h -N -p debug -o '%N %t' | awk '$2 ~ /^(idle|mix|alloc|comp)$/' | wc -l)" -eq "$NODES" ]
}
waitfor 60 scontrol ping || fail "slurmctld does not answer" "$LOGS/slurmctld.log"
waitfor 60 all_up || { sinfo -N >&2 || true; fail "nodes are not up after 60 s" "$LOGS/slurmctld.log" "$LOGS"/slurmd-n*.log; }
waitfor 30 sacct -n -X -S now-1minute || fail "sacct does not answer" "$LOGS/slurmdbd.log"

log "cluster '$CLUSTER' up in $(( $(date +%s) - T0 ))s (state $STATE${changed:+; new config: ${changed[*]}})"
log "nodes: $NODELIST, $CPUS CPUs, $NODE_MEM MB (DefMemPerCPU=$DEF_MEM), $GPUS fake GPUs each"
log "partitions: debug (default), cpu, gpu; account: $CLUSTER (sbatch --account $CLUSTER)"
sinfo
log "config: /etc/slurm/slurm.conf -> $ETC/slurm.conf (no SLURM_CONF needed); logs: $LOGS"
log "stop: bash $HERE/slurm_down.sh$([ "$STATE" = /var/tmp/hpcrl-slurm ] || echo " --state $STATE") [--wipe]"
