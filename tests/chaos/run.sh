#!/usr/bin/env bash
# tests/chaos/run.sh [--rounds N (default 30)] [--seed S] [--wide] [--muond PATH] [--keep]
# Random faults from a printed seed against two 4-rank jobs on one muond (tests/chaos/chaos.py):
# SIGKILL of a rank or of the daemon mid-step, SIGKILL of the daemon mid-save, ENOSPC and EIO in
# saves, a corrupted newest generation, a rank stalled past the step timeout; after each, the
# recovery a user would make (checkpoint load, reset, restart) and the lost steps replayed. Passes
# when every job's final state equals a fault-free run of the same steps bit for bit. Prints
# rounds, faults by kind, recoveries and bits lost. Exit 77 (skipped) when muond was built without
# -DMUOND_TEST_HOOKS=ON (the save faults need its $MUOND_TEST_CHECKPOINT_FAULT hook).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec /usr/bin/python3 "$here/chaos.py" "$@"
