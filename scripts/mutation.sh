#!/usr/bin/env bash
# Mutation testing of the scheduler, KV cache and worker batch/sampler with mutmut 3.
#
#   scripts/mutation.sh                       # all seven files, one after another
#   scripts/mutation.sh evenflow/core/kv/block_pool.py    # one (or a few) of them
#   MUTATION_JOBS=2 scripts/mutation.sh ...   # mutants tested in parallel (default 1)
#   scripts/mutation.sh --survivors evenflow/core/request.py   # after new tests: rerun only last run's survivors
#   MUTATION_ONLY='*prepare_inputs* *update*' scripts/mutation.sh evenflow/worker/batch.py   # only these globs
#
# Prints "file: killed/total" per file; mutmut keeps its state in mutants/ at the repository root
# (`scripts/mutation.sh --results` lists every mutant's status, `scripts/mutation.sh --show NAME`
# shows one) and the script a log and the results per file in build/mutation/, and the ledger of the run:
# build/mutation/ledger.md, each file's score and every survivor's diff (what docs/mutation.md's equivalents
# explain). Not run in CI: it takes minutes per file. See docs/mutation.md. Needs mutmut 3 (pip install -e ".[mutation]").
#
# It runs in place: the import path is the file path (evenflow/core/sched/scheduler.py is
# evenflow.core.sched.scheduler), which is how mutmut names a mutant. Each file's settings (what
# to mutate, which tests) go in a setup.cfg written at the root for the run and removed after it
# (mutmut reads setup.cfg when pyproject.toml has no [tool.mutmut]): one run at a time per tree.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=${MUTATION_DIR:-$repo/build/mutation}  # logs and results, per file
jobs=${MUTATION_JOBS:-1}
python=${PYTHON:-$repo/.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one core per mutant process: the machine is shared
[[ -x $python ]] || python=python

# The fast test subsets that exercise each file (the worker ones run the tiny model on CPU).
declare -A TESTS=(
  [evenflow/core/sched/scheduler.py]="tests/core tests/lora/test_lora_admission.py"
  [evenflow/core/sched/ledger.py]="tests/core tests/lora/test_lora_admission.py"
  [evenflow/core/kv/manager.py]="tests/core"
  [evenflow/core/kv/block_pool.py]="tests/core"
  [evenflow/core/request.py]="tests/core"
  [evenflow/worker/batch.py]="tests/worker/test_handbuilt_steps.py tests/worker/test_runner_api.py tests/worker/test_runner_correctness.py tests/worker/test_chunk_boundaries.py tests/worker/test_chunk_boundaries_spec.py tests/worker/test_chunk_boundaries_grammar.py tests/worker/test_runner_properties.py tests/worker/test_batch_edges.py"
  [evenflow/worker/sampler.py]="tests/worker/test_sampler.py tests/worker/test_sampler_edges.py"
)
ORDER=(evenflow/core/kv/block_pool.py evenflow/core/request.py evenflow/core/kv/manager.py evenflow/core/sched/scheduler.py
       evenflow/core/sched/ledger.py evenflow/worker/batch.py evenflow/worker/sampler.py)

run_one() {
  local file=$1 module=${1%.py}
  module=${module//\//.}
  [[ -n ${TESTS[$file]:-} ]] || { echo "no test subset for $file (known: ${ORDER[*]})" >&2; return 2; }
  [[ ! -e $repo/setup.cfg ]] || { echo "$repo/setup.cfg exists: another run in progress?" >&2; return 1; }
  trap 'rm -f "$repo/setup.cfg"' RETURN
  {
    echo "[mutmut]"
    echo "source_paths = evenflow"
    echo "only_mutate = $file"
    echo "pytest_add_cli_args_test_selection ="
    printf '    %s\n' ${TESTS[$file]}
    echo "pytest_add_cli_args ="
    # A mutant that loops forever fails its test after this long instead of waiting out mutmut's
    # own timeout (minutes on a loaded machine): a hang is a detection too.
    printf '    %s\n' -p no:cacheprovider -m "not slow and not cuda" --timeout=60
    # Each mutant runs in a process forked from a server that never ran torch: forking after
    # torch started its thread pool deadlocks the child.
    echo "process_isolation = forkserver"
  } > "$repo/setup.cfg"
  local names=("$module.*")
  if [[ $survivors_only == 1 && -f $root/$module.results.txt ]]; then
    mapfile -t names < <(sed -n 's/^ *\(.*\): survived$/\1/p' "$root/$module.results.txt")
    [[ ${#names[@]} -gt 0 ]] || { echo "$file: no survivors to rerun"; return 0; }
  elif [[ -n ${MUTATION_ONLY:-} ]]; then
    read -ra names <<< "$MUTATION_ONLY"  # space-separated globs; read does not expand them
  fi
  mkdir -p "$root"
  # mutmut regenerates mutants/ only for sources it finds changed: after another file's run it would
  # mutate nothing (and fail collecting stats), so mutants/ is made afresh whenever the file changes.
  if [[ $(cat "$root/.mutated_file" 2>/dev/null) != "$file" ]]; then rm -rf "$repo/mutants"; fi
  echo "$file" > "$root/.mutated_file"
  # PYTHONPATH would put the unmutated tree before mutants/ (mutmut puts mutants/ first itself).
  (cd "$repo" && PYTHONPATH= nice -n 10 "$python" -m mutmut run --max-children "$jobs" "${names[@]}" \
      > "$root/$module.log" 2>&1) || {
    echo "$file: mutmut failed, see $root/$module.log" >&2; tail -20 "$root/$module.log" >&2; return 1; }
  (cd "$repo" && "$python" -m mutmut results --all true | grep -F "$module." > "$root/$module.results.txt" || true)
  local total killed score
  total=$(grep -c ': ' "$root/$module.results.txt" || true)
  killed=$(grep -c ': killed$' "$root/$module.results.txt" || true)
  score="$file: $killed/$total killed ($(grep -v ': killed$' "$root/$module.results.txt" | awk '{print $NF}' | sort | uniq -c | tr -s ' ' | paste -sd, -))"
  echo "$score"
  write_ledger "$module" "$score"
}

# The run's ledger entry for one file: when, how loaded, the score, every mutant that was not killed
# with its diff. build/mutation/ledger.md is remade from the entries after each file.
write_ledger() {
  local module=$1 score=$2 entry=$root/$1.ledger.md name status
  {
    echo "## \`${module//.//}.py\`"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg), $jobs job(s): $score"
    echo
    while read -r name status; do
      name=${name%:}
      echo "- \`$name\`: $status"
      echo '  ```diff'
      (cd "$repo" && "$python" -m mutmut show "$name" 2>/dev/null | grep -E '^[-+][^-+]' | sed 's/^/  /')
      echo '  ```'
    done < <(grep -v -e ': killed$' -e ': checked$' "$root/$module.results.txt")  # checked: not run this time
    echo
  } > "$entry"
  {
    echo "# Mutation run ledger (written by scripts/mutation.sh)"
    echo
    cat "$root"/*.ledger.md
  } > "$root/ledger.md"
}

# mutmut's own views of the state in mutants/ (it needs a config to start): --results, --show NAME.
if [[ ${1:-} == --results || ${1:-} == --show ]]; then
  [[ ! -e $repo/setup.cfg ]] || { echo "$repo/setup.cfg exists: another run in progress?" >&2; exit 1; }
  trap 'rm -f "$repo/setup.cfg"' EXIT
  printf '[mutmut]\nsource_paths = evenflow\n' > "$repo/setup.cfg"
  view=${1#--}; shift
  cd "$repo" && PYTHONPATH= "$python" -m mutmut "$view" "$@"
  exit
fi

survivors_only=0
if [[ ${1:-} == --survivors ]]; then survivors_only=1; shift; fi
files=("$@")
[[ ${#files[@]} -gt 0 ]] || files=("${ORDER[@]}")
for file in "${files[@]}"; do run_one "$file"; done
