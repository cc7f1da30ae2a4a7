#!/usr/bin/env bash
# A bench run against an earlier commit, side by side: REV's tree (a git worktree) and this
# tree take turns ROUNDS times (default 2), so both see the same host. REV keeps its own
# kernel build (a HOME of its own under ~/.cache/mashbox/against/, kept for the next run)
# so neither rebuilds the other's; both share the model cache.
#
#   bash bench/against_rev.sh 884b2ef bench/decode_http.py --streams 1 4 8 --slots 8
#   ROUNDS=3 bash bench/against_rev.sh HEAD~3 bench/step_profile.py --kinds int4 --top 0
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1
shift
rev_home="$HOME/.cache/mashbox/against/$(git rev-parse --short "$rev")"
base=$(mktemp -d /tmp/mashbox-rev.XXXXXX)
trap 'git worktree remove --force "$base/tree" >/dev/null 2>&1 || true; rm -rf "$base"' EXIT
git worktree add --detach "$base/tree" "$rev" >/dev/null
export MASHBOX_MODELS_DIR=${MASHBOX_MODELS_DIR:-$HOME/.cache/mashbox/models}
for round in $(seq "${ROUNDS:-2}"); do
  for side in "$rev" this; do
    echo "== $side (round $round, $(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
    if [ "$side" = this ]; then
      PYTHONPATH="$PWD/src" .venv/bin/python "$@"
    else
      mkdir -p "$rev_home"
      # The bench script is this tree's; the server and engine it starts are REV's.
      HOME="$rev_home" PYTHONPATH="$base/tree/src" .venv/bin/python "$@"
    fi
  done
done
