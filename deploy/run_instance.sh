#!/usr/bin/env bash
# One container per instance, as in the Ascend PD-separation guide (steps 6-8): this script turns
# a local ranktable into the matching `docker run` of the pdserve image, whose entry point is
# deploy/start_servers.sh (the role is decided again inside the container, from the same tables).
#
# Design choice: everything the container needs is derived from the ranktables, so the command
# line of every instance stays the guide's one; only the table and --port differ:
#   - GPUs: the local table's device ids -> --gpus '"device=4,5"' (none for the _host table).
#     Inside the container they are CUDA ordinals 0..n-1 in that order (CUDA_DEVICE_ORDER=PCI_BUS_ID).
#   - network: --net=host (the ranktables carry host addresses; NODE_PORTS are host ports).
#   - mounts: the model directory read-only at the same path (the flag --model is passed through
#     unchanged), the two ranktables read-only under /etc/pdserve/ranktable/.
#   - env: GLOBAL_RANK_TABLE_FILE_PATH, RANK_TABLE_FILE_PATH (container paths), NODE_PORTS, USE_OPENAI,
#     PD_LOG_LEVEL, VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND and PD_CPU_BUDGET when set.
#   - CPU instances (--no-gpus): the host's core budget /dev/shm/pdserve-cpu-NAME (PD_CPU_BUDGET,
#     default host) mounted at the same path, so the containers of one host share its cores
#     (not with PD_CPU_BUDGET=off or pinned threads).
#
#   deploy/run_instance.sh [options] [--] FLAGS...
#     --global FILE       global ranktable (default $GLOBAL_RANK_TABLE_FILE_PATH)
#     --local FILE        this instance's local ranktable (default $RANK_TABLE_FILE_PATH)
#     --image IMAGE       image to run (default $PD_IMAGE, else pdserve:latest)
#     --name NAME         container name (default pd-<role>-<index>-<host>)
#     --shm-size SIZE     /dev/shm size (default 16g)
#     --node-ports LIST   NODE_PORTS (default $NODE_PORTS; required for the scheduler)
#     --use-openai 0|1    USE_OPENAI (default $USE_OPENAI, else 1)
#     --docker-arg ARG    one more argument for `docker run` (repeatable), e.g. --docker-arg=--restart=always
#     --foreground        run attached (default: -d, detached)
#     --no-gpus           no --gpus (the CPU image, deploy/Dockerfile.cpu, on a host without GPUs)
#     --dry-run           print the docker command (shell-quoted, one line) instead of running it
#   Every other argument (the guide's --model, --tensor-parallel-size, --port, ...) goes to
#   start_servers.sh inside the container unchanged. --model DIR must be an existing directory.
# When pd-ranktable is found ($PD_BIN_DIR, ./build-release, ./build, PATH), the tables are checked
# with it first.
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@" # `sh run_instance.sh` (dash) re-runs under bash
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
me=run_instance.sh

die() { echo "$me: $*" >&2; exit 1; }
usage() { sed -n '18,32p' "$0" | sed 's/^# \{0,1\}//'; }

global=${GLOBAL_RANK_TABLE_FILE_PATH:-} local=${RANK_TABLE_FILE_PATH:-}
image=${PD_IMAGE:-pdserve:latest} name="" shm=16g
node_ports=${NODE_PORTS:-} use_openai=${USE_OPENAI:-1}
detach=1 dry=0 gpus=1 model=""
docker_extra=() pass=()

need() { [ $# -ge 2 ] || die "$1 needs a value (try --help)"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --global) need "$@"; global=$2; shift ;;
    --global=*) global=${1#*=} ;;
    --local) need "$@"; local=$2; shift ;;
    --local=*) local=${1#*=} ;;
    --image) need "$@"; image=$2; shift ;;
    --image=*) image=${1#*=} ;;
    --name) need "$@"; name=$2; shift ;;
    --name=*) name=${1#*=} ;;
    --shm-size) need "$@"; shm=$2; shift ;;
    --shm-size=*) shm=${1#*=} ;;
    --node-ports) need "$@"; node_ports=$2; shift ;;
    --node-ports=*) node_ports=${1#*=} ;;
    --use-openai) need "$@"; use_openai=$2; shift ;;
    --use-openai=*) use_openai=${1#*=} ;;
    --docker-arg) need "$@"; docker_extra+=("$2"); shift ;;
    --docker-arg=*) docker_extra+=("${1#*=}") ;;
    --foreground) detach=0 ;;
    --no-gpus) gpus=0 ;;
    --dry-run) dry=1 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; pass+=("$@"); break ;;
    *) pass+=("$1") ;;
    esac
    shift
done

[ -n "$global" ] || die "no global ranktable: pass --global FILE or set GLOBAL_RANK_TABLE_FILE_PATH"
[ -n "$local" ] || die "no local ranktable: pass --local FILE or set RANK_TABLE_FILE_PATH"
for f in "$global" "$local"; do [ -r "$f" ] || die "cannot read ranktable $f"; done
case "$use_openai" in 0|1) ;; *) die "USE_OPENAI must be 0 or 1, got '$use_openai'" ;; esac
# --model DIR (or --model=DIR) stays in the pass-through flags; its directory is mounted.
for ((i = 0; i < ${#pass[@]}; i++)); do
    case "${pass[$i]}" in
    --model) [ $((i + 1)) -lt ${#pass[@]} ] || die "--model needs a value"; model=${pass[$((i + 1))]} ;;
    --model=*) model=${pass[$i]#*=} ;;
    esac
done
if [ -n "$model" ]; then
    [ -d "$model" ] || die "--model $model is not a directory on this host"
    case "$model" in /*) ;; *) die "--model $model: give an absolute path (it is the same path inside the container)" ;; esac
fi

# Full validation with pd-ranktable when it is at hand (the docker host may have only the image).
rt=""
dirs=("$here/build-release" "$here/build")
[ -z "${PD_BIN_DIR:-}" ] || dirs=("$PD_BIN_DIR")
for d in "${dirs[@]}"; do
    for c in "$d/ranktable/cli/pd-ranktable" "$d/pd-ranktable"; do
        [ -x "$c" ] && { rt=$c; break 2; }
    done
done
[ -n "$rt" ] || rt=$(command -v pd-ranktable || true)
if [ -n "$rt" ]; then
    out=$("$rt" --mode check --global-ranktable-list "$global" --local-ranktable-list "$local" 2>&1) ||
        die "$local does not match an instance of $global:
$out"
fi

# role, index in its group, host, device ids: read with python3 (json is in every python3).
py=$(command -v python3 || true)
[ -n "$py" ] || die "python3 is needed to read the ranktables"
info=$("$py" - "$global" "$local" <<'PY'
import json, sys
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"{p}: {e}")
g, l = load(sys.argv[1]), load(sys.argv[2])
try:
    me = l["server_list"][0]
    devs = [d["device_id"] for d in me.get("device", [])]
    key = (me["server_id"], me["server_ip"], devs)
    groups = {grp["group_id"]: grp["server_list"] for grp in g["server_group_list"]}
except (KeyError, IndexError, TypeError) as e:
    sys.exit(f"{sys.argv[2]}: not a ranktable ({e!r} missing)")
roles = {"0": "scheduler", "1": "prefill", "2": "decode"}
for gid, role in roles.items():
    for i, s in enumerate(groups.get(gid, [])):
        if (s.get("server_id"), s.get("server_ip"), [d["device_id"] for d in s.get("device", [])]) == key:
            print(role, i, me["server_ip"], ",".join(devs))
            sys.exit(0)
sys.exit(f"{sys.argv[2]}: matches no instance of {sys.argv[1]} "
         f"(server_id {key[0]}, server_ip {key[1]}, devices {','.join(devs) or 'none'})")
PY
) || die "${info:-cannot read the ranktables}"
read -r role index host devices <<<"$info"

if [ "$role" = scheduler ]; then
    [ -n "$node_ports" ] || die "the scheduler needs NODE_PORTS (one port per prefill then decode instance): pass --node-ports or set NODE_PORTS"
fi
[ -n "$name" ] || name="pd-$role-$index-$host"
name=$(tr -c 'a-zA-Z0-9_.\n-' '-' <<<"$name")  # docker names: [a-zA-Z0-9][a-zA-Z0-9_.-]*

ctr_rt=/etc/pdserve/ranktable
g_in="$ctr_rt/$(basename "$global")" l_in="$ctr_rt/$(basename "$local")"
[ "$g_in" != "$l_in" ] || die "the global and local ranktables have the same file name ($(basename "$local"))"
abs() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }

cmd=(docker run)
[ "$detach" = 1 ] && cmd+=(-d)
cmd+=(--name "$name" --net=host --shm-size "$shm")
[ -n "$devices" ] && [ "$gpus" = 1 ] && cmd+=(--gpus "\"device=$devices\"" -e CUDA_DEVICE_ORDER=PCI_BUS_ID)
cmd+=(-v "$(abs "$global"):$g_in:ro" -v "$(abs "$local"):$l_in:ro")
[ -n "$model" ] && cmd+=(-v "$model:$model:ro")
cmd+=(-e "GLOBAL_RANK_TABLE_FILE_PATH=$g_in" -e "RANK_TABLE_FILE_PATH=$l_in"
      -e "NODE_PORTS=$node_ports" -e "USE_OPENAI=$use_openai")
for v in PD_LOG_LEVEL VLLM_CPU_KVCACHE_SPACE VLLM_CPU_OMP_THREADS_BIND PD_CPU_BUDGET; do
    [ -n "${!v:-}" ] && cmd+=(-e "$v=${!v}")
done
# CPU instances of one host share its cores through the budget's segment in the host's /dev/shm
# (PD_CPU_BUDGET, docs/nodes.md); it must exist before the mount, or docker makes a directory
budget=${PD_CPU_BUDGET:-host}
if [ "$gpus" = 0 ] && [ "$role" != scheduler ] && [ "$budget" != off ] && [ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" ]; then
    seg=/dev/shm/pdserve-cpu-$budget
    [ "$dry" = 1 ] || [ -e "$seg" ] || (umask 077 && : >>"$seg") || die "cannot create $seg"
    cmd+=(-v "$seg:$seg")
fi
cmd+=("${docker_extra[@]}" "$image" "${pass[@]}")

if [ "$dry" = 1 ]; then
    q() { # shell-quote one word only when it needs it
        if [[ $1 =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then printf '%s' "$1"
        else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
    }
    line=""
    for w in "${cmd[@]}"; do line+="${line:+ }$(q "$w")"; done
    echo "$line"
    exit 0
fi
command -v docker >/dev/null 2>&1 || die "docker is not installed on this host"
exec "${cmd[@]}"
