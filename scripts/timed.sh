#!/usr/bin/env bash
# One CI step within its time budget: `scripts/timed.sh NAME BUDGET_S COMMAND...` runs COMMAND,
# prints how long it took, and fails (exit 1) with a message naming the budget when it took longer,
# so a suite that grows slow goes red for whoever made it slow, long before CI's 90-minute cutoff.
# COMMAND's own failure passes through with its exit code. BUDGET_S 0 means no budget.
set -uo pipefail
name=$1 budget=$2
shift 2
started=$SECONDS
"$@"
status=$?
took=$((SECONDS - started))
echo "ci: $name took ${took} s ($((took / 60)) min $((took % 60)) s)$([ "$budget" -gt 0 ] && echo ", budget ${budget} s")"
[ "$status" -eq 0 ] || exit "$status"
if [ "$budget" -gt 0 ] && [ "$took" -gt "$budget" ]; then
  echo "ci: FAILED: $name took ${took} s, over its budget of ${budget} s. Find the slow part in the table of" \
    "where the time went ('make test-times' writes it as JSON) and make it faster; do not raise the budget." >&2
  exit 1
fi
