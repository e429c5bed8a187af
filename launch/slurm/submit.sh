#!/bin/bash
# Submit launch/slurm/searchr1.sbatch with the shape the config's plan asks for.
#
#   bash launch/slurm/submit.sh CONFIG [key=value ...] [-- sbatch options ...]
#   bash launch/slurm/submit.sh configs/searchr1.toml                 # --nodes=2 --gpus-per-node=8 --exclusive
#   bash launch/slurm/submit.sh configs/tiny.toml -- --partition=cpu  # --nodes=1, CPU: no --gpus-per-node
#
# Runs the config's --dry-run here (a bad config fails before anything is queued), reads cluster.num_nodes,
# cluster.num_devices_per_node and rollout.rollout_backend from its plan and calls
#   sbatch --nodes=N [--gpus-per-node=P --exclusive] --cpus-per-task=C [sbatch options] searchr1.sbatch CONFIG ...
# --gpus-per-node (and --exclusive) only for a GPU config (rollout_backend = "sglang"). C: CPUS_PER_TASK, default 64
# for a GPU config, P (one CPU per rank) for a CPU one. Your sbatch options come after these, so they win.
# Environment knobs: PYTHON (python), SBATCH (sbatch), CPUS_PER_TASK; the job's own (RUN_NAME, RUN_DIR, ...) are
# passed on by sbatch (see searchr1.sbatch).
set -euo pipefail

if [ "$#" -lt 1 ] || [ "$1" = "--" ]; then
    echo "usage: bash launch/slurm/submit.sh CONFIG [key=value ...] [-- sbatch options ...]" >&2
    exit 2
fi
CONFIG="$1"
shift
OVERRIDES=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    OVERRIDES+=("$1")
    shift
done
if [ "$#" -gt 0 ]; then shift; fi  # the "--"
PYTHON="${PYTHON:-python}"
SCRIPT="$(dirname "$0")/searchr1.sbatch"

PLAN="$(env -u SLURM_JOB_ID -u SLURM_NODEID "$PYTHON" launch/train.py "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"} --dry-run)"
value() { printf '%s\n' "$PLAN" | sed -n "s/^$1 = \"\{0,1\}\([^\"]*\)\"\{0,1\}\$/\1/p" | head -n1 || true; }
NODES="$(value num_nodes)"
NPROC="$(value num_devices_per_node)"
BACKEND="$(value rollout_backend)"
if [ -z "$NODES" ] || [ -z "$NPROC" ] || [ -z "$BACKEND" ]; then
    echo "submit.sh: no cluster.num_nodes / cluster.num_devices_per_node / rollout.rollout_backend in the plan of" \
         "$CONFIG" >&2
    exit 2
fi
SHAPE=(--nodes="$NODES")
if [ "$BACKEND" = "sglang" ]; then
    SHAPE+=(--gpus-per-node="$NPROC" --exclusive --cpus-per-task="${CPUS_PER_TASK:-64}")
else
    SHAPE+=(--cpus-per-task="${CPUS_PER_TASK:-$NPROC}")
fi
echo "submit.sh: $CONFIG: $NODES node(s) x $NPROC rank(s), rollout_backend $BACKEND: ${SHAPE[*]}"
exec "${SBATCH:-sbatch}" "${SHAPE[@]}" "$@" "$SCRIPT" "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
