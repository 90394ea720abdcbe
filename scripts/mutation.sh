#!/usr/bin/env bash
# Mutation testing of the scheduler, KV cache and worker batch/sampler with mutmut 3.
#
#   scripts/mutation.sh                       # all six files, one after another
#   scripts/mutation.sh evenflow/core/kv/block_pool.py    # one (or a few) of them
#   MUTATION_JOBS=2 scripts/mutation.sh ...   # mutants tested in parallel (default 1)
#   scripts/mutation.sh --survivors evenflow/core/request.py   # after new tests: rerun only last run's survivors
#   MUTATION_ONLY='*prepare_inputs* *update*' scripts/mutation.sh evenflow/worker/batch.py   # only these globs
#
# Prints "file: killed/total" per file and leaves the details in build/mutation/<file>/
# (`cd build/mutation/core_scheduler && mutmut results` lists survivors, `mutmut show NAME`
# shows one). Not run in CI: it takes minutes per file. See docs/mutation.md.
# Needs mutmut 3 (pip install -e ".[mutation]").
#
# Why a staging folder: mutmut names a mutant by its file path (evenflow/core/sched/scheduler.py ->
# core.scheduler) and only runs it when that equals the function's __module__, which here is
# evenflow.core.sched.scheduler (pyproject maps package dirs). So each run copies the parts into
# src/evenflow/<part> (mutmut drops a leading "src."), with the tests and a pyproject holding
# only the mutmut and pytest settings. The editable install's import hook comes after the
# path-based finder, so the tests import the mutated copy from mutants/src.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=${MUTATION_DIR:-$repo/build/mutation}
jobs=${MUTATION_JOBS:-1}
python=${PYTHON:-$repo/.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one core per mutant process: the machine is shared
[[ -x $python ]] || python=python

# The fast test subsets that exercise each file (the worker ones run the tiny model on CPU).
declare -A TESTS=(
  [evenflow/core/sched/scheduler.py]="tests/core"
  [evenflow/core/kv/manager.py]="tests/core"
  [evenflow/core/kv/block_pool.py]="tests/core"
  [evenflow/core/request.py]="tests/core"
  [evenflow/worker/batch.py]="tests/worker/test_handbuilt_steps.py tests/worker/test_runner_api.py tests/worker/test_runner_correctness.py tests/worker/test_chunk_boundaries.py tests/worker/test_chunk_boundaries_spec.py tests/worker/test_chunk_boundaries_grammar.py tests/worker/test_runner_properties.py tests/worker/test_batch_edges.py"
  [evenflow/worker/sampler.py]="tests/worker/test_sampler.py tests/worker/test_sampler_edges.py"
)
ORDER=(evenflow/core/kv/block_pool.py evenflow/core/request.py evenflow/core/kv/manager.py evenflow/core/sched/scheduler.py evenflow/worker/batch.py evenflow/worker/sampler.py)

toml_list() {  # words -> a TOML array of strings
  local out="" word
  for word in "$@"; do out+="${out:+, }\"$word\""; done
  printf '[%s]' "$out"
}

run_one() {
  local file=$1 slug=${1//\//_}
  slug=${slug%.py}
  local stage=$root/$slug
  [[ -n ${TESTS[$file]:-} ]] || { echo "no test subset for $file (known: ${ORDER[*]})" >&2; return 2; }
  mkdir -p "$stage/src/evenflow"
  # cp -p keeps mtimes, so mutmut reuses earlier results for files that did not change.
  for part in core worker protocol frontend tests; do
    local dest=$stage/src/evenflow/$part
    [[ $part == tests ]] && dest=$stage/tests
    rm -rf "$dest" && cp -rp "$repo/$part" "$dest"
    find "$dest" -name __pycache__ -prune -exec rm -rf {} +
  done
  # shellcheck disable=SC2086
  cat > "$stage/pyproject.toml" <<EOF
[tool.mutmut]
source_paths = ["src"]
only_mutate = ["src/evenflow/$file"]
pytest_add_cli_args_test_selection = $(toml_list ${TESTS[$file]})
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not slow and not cuda"]
use_git_change_detection = false
# Each mutant runs in a process forked from a server that never ran torch: forking after torch
# started its thread pool deadlocks the child.
process_isolation = "forkserver"

[tool.pytest.ini_options]
testpaths = ["tests"]
markers = ["slow: end-to-end tests across processes", "cuda: needs a CUDA device"]
timeout = 600
EOF
  local names=()
  if [[ $survivors_only == 1 && -f $stage/results.txt ]]; then
    mapfile -t names < <(sed -n 's/^ *\(.*\): survived$/\1/p' "$stage/results.txt")
    [[ ${#names[@]} -gt 0 ]] || { echo "$file: no survivors to rerun"; return 0; }
  elif [[ -n ${MUTATION_ONLY:-} ]]; then
    read -ra names <<< "$MUTATION_ONLY"  # space-separated globs; read does not expand them
  fi
  (cd "$stage" && nice -n 10 "$python" -m mutmut run --max-children "$jobs" "${names[@]}" > run.log 2>&1) || {
    echo "$file: mutmut failed, see $stage/run.log" >&2; tail -20 "$stage/run.log" >&2; return 1; }
  (cd "$stage" && "$python" -m mutmut results --all true > results.txt)
  local total killed
  total=$(grep -c ': ' "$stage/results.txt" || true)
  killed=$(grep -c ': killed$' "$stage/results.txt" || true)
  echo "$file: $killed/$total killed ($(grep -v ': killed$' "$stage/results.txt" | awk '{print $NF}' | sort | uniq -c | tr -s ' ' | paste -sd, -))"
}

survivors_only=0
if [[ ${1:-} == --survivors ]]; then survivors_only=1; shift; fi
files=("$@")
[[ ${#files[@]} -gt 0 ]] || files=("${ORDER[@]}")
for file in "${files[@]}"; do run_one "$file"; done
