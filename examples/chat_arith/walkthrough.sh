#!/usr/bin/env bash
# The chat example end to end, as a user runs it: from the repository root, with .venv/bin on PATH,
#
#     examples/chat_arith/walkthrough.sh
#
# Each step is one command of docs/tutorial.md. What it writes goes under runs/ of the current
# directory (runs/chat_arith: the dataset, the export; runs/stack: the stack's run directory);
# the run config (CONFIG, default examples/chat_arith/run.toml) names the model directory and the
# training file, relative to itself. tests/e2e/test_chat_arith.py runs this script in a temporary
# directory with a copy of the config whose paths point there.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CONFIG=${CONFIG:-$HERE/run.toml}
WORK=runs/chat_arith

step() { printf '\n== %s\n' "$*"; }

# What make run leaves out: the data extra (pyarrow, datasets: steps 1 and 4) and the trackers extra
# (tensorboard: steps 5 and 6). Missing, the script would fail minutes in, at step 4 or 5.
python -c 'import datasets, pyarrow, tensorboard' 2>/dev/null \
    || { echo "walkthrough.sh needs the data and trackers extras: run make extras" >&2; exit 1; }

step "1. the dataset: Parquet, one chat conversation and its solution per row"
python "$HERE/make_data.py" "$WORK"

step "2. the policy: the arith model given a chat template, cold-started on chat-rendered prompts"
python -m examples.chat_arith.bootstrap --config "$CONFIG"

step "3. the stack, with the reward function importable (PYTHONPATH) and allowed (TANDEM_REWARD_FUNCTIONS)"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export TANDEM_REWARD_FUNCTIONS='["arith_reward:reward"]'
tandem up --config "$CONFIG" > "$WORK/up.log" 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null && wait $up' EXIT
until grep -q "tandem is up" "$WORK/up.log"; do
    kill -0 $up 2>/dev/null || { tail -n 20 "$WORK/up.log"; exit 1; }
    sleep 1
done
grep "tandem is up" "$WORK/up.log"

step "4. import the dataset: the conversation column as chat messages, each line scored by the reward function"
train=$(tandem prompts import "$WORK/train.parquet" --map messages=conversation,solution=solution \
    --reward python --set function=arith_reward:reward)
held_out=$(tandem prompts import "$WORK/eval.parquet" --map messages=conversation,solution=solution \
    --reward python --set function=arith_reward:reward)
tandem prompts list

step "5. train on the imported set, evaluated on the held-out one"
run=$(tandem submit --config "$CONFIG" --prompt-set "$train" --eval-prompt-set "$held_out")
tandem status "$run" --watch > /dev/null
tandem status "$run"

step "6. the TensorBoard events, and the best version exported as a Hugging Face folder"
ls runs/stack/"$run"/trackers/tensorboard/"$run"
tandem export "$run" "$WORK/export" --version best
