#!/usr/bin/env bash
# CI, part 2: pippy_split on the newest torch that pip installs here without a pin (docs/testing.md, "Which
# torch"). A fresh venv gets `pip install -e ".[test]"` and nothing else, so pip picks torch itself:
# 2.14.1 where pip is capped to the wheels on this machine's disk, else the newest on PyPI. Then, on
# it: the main job, tests/compat (the drop-in against the installed torch's own pipelining API and
# the recorded releases), the schedules on 2 ranks, PP x FSDP2 on a 2 x 2 mesh, one real
# architecture. 826 s on 2 shared cores with 2.14.1 (389 s of them installing); the venv (5.4 GB)
# is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.ci-venv-newest
rm -rf "$venv"
python -m venv "$venv"
job_dir=$(mktemp -d)
trap 'rm -rf "$job_dir" "$venv"' EXIT
start=$SECONDS
"$venv/bin/python" -m pip install --quiet -e ".[test]"
version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
echo "CI: newest torch: $version, installed with the test extra in $((SECONDS - start)) s"

"$venv/bin/pippy-split" train --steps 100 --checkpoint "$job_dir/ckpt" > "$job_dir/train.log" 2>&1 || {
    tail -40 "$job_dir/train.log"; echo "CI: the main job failed on torch $version" >&2; exit 1; }
for expected in "correct sums:" "checkpoint saved to"; do
    if ! grep -q "$expected" "$job_dir/train.log"; then
        echo "CI: the main job on torch $version printed no '$expected'" >&2
        exit 1
    fi
done

on_newest() { "$venv/bin/python" -m pytest -x -p no:cacheprovider "$@"; }
on_newest tests/compat
on_newest tests/dist/test_schedules.py -k "tiny_gpt and (Interleaved1F1B or LoopedBFS or ZeroBubble or DualPipeV)"
on_newest "tests/dist/test_nd_parallel.py::test_hand_built_stages_with_per_block_fsdp2_on_a_mesh_are_exact[1F1B]"
on_newest tests/models/test_real_archs.py -k qwen3
echo "CI: torch $version: the main job, tests/compat, the schedules on 2 ranks, PP x FSDP2 and qwen3 pass" \
     "($((SECONDS - start)) s with the install)"
