#!/usr/bin/env bash
# CI, part 2b: pippy_split as torchtitan's pipeline engine, against torchtitan itself. A fresh venv
# gets torch==2.13.0 first (pinned: torchtitan 0.3.0 keeps it), then `pip install -e ".[torchtitan,test]"`,
# then `--no-deps triton==3.8.0` (torchtitan imports triton unconditionally; on a CPU machine nothing
# else would install it, and its own dependencies are not wanted). Then tests/torchtitan, tutorial 09
# and the compat tests of torchtitan's calls: Llama 3, Qwen3 and DeepSeek-V3 under the Trainer's call
# sequence through pippy_split's pipeline_llm and through the compat route, on 2 and 4 gloo ranks
# (PP x FSDP2, PP x TP, full AC and per-block compile through torchtitan's parallelize_fn).
# 234 s on 2 shared cores (150 s of them installing; 358 s under a load of 6); the venv is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.ci-venv-torchtitan
rm -rf "$venv"
python -m venv "$venv"
trap 'rm -rf "$venv"' EXIT
start=$SECONDS
"$venv/bin/python" -m pip install --quiet torch==2.13.0
"$venv/bin/python" -m pip install --quiet -e ".[torchtitan,test]"
"$venv/bin/python" -m pip install --quiet --no-deps triton==3.8.0
version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
case "$version" in
    2.13.0*) ;;
    *) echo "CI: torchtitan's venv has torch $version, not 2.13.0" >&2; exit 1 ;;
esac
echo "CI: torchtitan $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torchtitan"))') on torch $version, installed in $((SECONDS - start)) s"

on_titan() { "$venv/bin/python" -m pytest -x -p no:cacheprovider "$@"; }
on_titan tests/torchtitan tests/compat/test_torchtitan_calls.py
on_titan tests/test_tutorials.py -k "09"
echo "CI: tests/torchtitan, torchtitan's calls into compat and tutorial 09 pass ($((SECONDS - start)) s with the install)"
