#!/usr/bin/env bash
# N mashbox replicas on this machine and SGLang's model gateway (smg) in front of them, until
# Ctrl-C (docs/scale-out.md). `nox -s router -- ARGS` runs it in nox's virtualenv.
#
#   bench/replicas.sh                                  # 2 replicas of the default model
#   bench/replicas.sh -n 3 -p round_robin MODEL        # 3 replicas, another policy
#   bench/replicas.sh -- --slots 8 --cache-ram 4096    # the rest goes to each `mashbox run`
#
# Clients talk to http://127.0.0.1:PORT (default 30000); replica i listens on PORT+i. With
# MASHBOX_API_KEY set, every replica asks for that key and smg is given it (--api-key): smg
# then asks its own clients for the same key, as `Authorization: Bearer`.
set -euo pipefail

replicas=2
policy=cache_aware
port=30000
model=smollm2-135m-instruct
threads=$(($(nproc) / 2 > 0 ? $(nproc) / 2 : 1))
usage="usage: $0 [-n REPLICAS] [-p POLICY] [-P PORT] [-t THREADS] [MODEL] [-- MASHBOX-ARGS]"
while [[ $# -gt 0 ]]; do
    case $1 in
        -n) replicas=$2; shift 2 ;;
        -p) policy=$2; shift 2 ;;
        -P) port=$2; shift 2 ;;
        -t) threads=$2; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        --) shift; break ;;
        -*) echo "$usage" >&2; exit 2 ;;
        *) model=$1; shift ;;
    esac
done
threads=$((threads / replicas > 0 ? threads / replicas : 1))

pids=()
cleanup() {
    # SIGTERM: smg stops taking requests; each replica drains (--drain-timeout) and exits.
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

workers=()
for i in $(seq 1 "$replicas"); do
    mashbox run "$model" --port $((port + i)) --threads "$threads" --drain-timeout 30 \
        --vllm-metrics "$@" &
    pids+=($!)
    workers+=("http://127.0.0.1:$((port + i))")
done
for url in "${workers[@]}"; do  # smg registers a worker from its /v1/models: wait until ready
    until curl -sf -o /dev/null "$url/health"; do
        kill -0 "${pids[@]}" || exit 1
        sleep 0.5
    done
done

key=()
if [[ -n ${MASHBOX_API_KEY:-} ]]; then key=(--api-key "$MASHBOX_API_KEY"); fi
smg launch --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 \
    --prometheus-port $((port + 100)) --worker-urls "${workers[@]}" --policy "$policy" \
    --log-level warn "${key[@]}" &
pids+=($!)
echo "replicas: ${workers[*]}; point clients at http://127.0.0.1:$port/v1 (policy $policy)"
wait -n "${pids[@]}"
