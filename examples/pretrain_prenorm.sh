#!/usr/bin/env bash
# Train the Pre-Norm Llama on the embedded news corpus (built on first use) through DeepSpeed.
#
#   deepspeed examples/pretrain_prenorm.sh                 # DeepSpeed's launcher (all local devices)
#   deepspeed --num_gpus 2 examples/pretrain_prenorm.sh    # two ranks (CPU ranks over gloo here)
#   bash examples/pretrain_prenorm.sh [--flag value ...]   # one process
#
# Any megapost flag appended overrides the defaults (see megapost/example.py), e.g.
#   --preset paper-180m --data-path /data/c4/c4_text_document --tokenizer-model /data/tok.model
# This file is both a bash script and a Python program: DeepSpeed's launcher runs its target with
# the Python interpreter on every rank; bash re-executes it with Python.
"exec" "${PYTHON:-python3}" "-u" "$0" "$@"  # bash re-runs this file with Python; Python sees a string
import sys

from megapost.example import run_example

run_example("pre", __file__, sys.argv[1:])
