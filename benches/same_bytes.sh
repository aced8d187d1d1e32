#!/usr/bin/env bash
# Output-byte fingerprint of every merge method: runs each mergekit fixture recipe
# (tests/fixtures/recipes/*.yml) and the CLI-only variants (ram+ rules and scopes, fisher, iso_c, tsv, resmerge, svc) on the
# demo models and prints one line per output file: "<case> <file> <sha256>". Run it with two
# binaries and diff the lists to show a change kept the output bytes (the refactoring check).
#
#   benches/same_bytes.sh BIN [MODEL_SIZE=tiny|1GiB…] [DEVICE=cpu] > list.txt
#
# The record (rlmerge_record.json; rlmerge_recipe.json in older builds) holds paths and versions, so
# it is left out; the model card (README.md), config and mergekit_config.yml are printed.
set -euo pipefail
bin=$(realpath "$1")
size=${2:-tiny}
device=${3:-cpu}
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
if [ "$size" = tiny ]; then
    "$bin" demo "$dir/m" --write-only --quiet >/dev/null
else
    "$bin" demo "$dir/m" --model-size "$size" --write-only --quiet >/dev/null
fi
cd "$dir/m"
print() {
    for f in "$2"/*; do
        case "$(basename "$f")" in rlmerge_recipe.json | rlmerge_record.json) continue ;; esac
        printf '%s %s %s\n' "$1" "$(basename "$f")" "$(sha256sum <"$f" | cut -d' ' -f1)"
    done
    rm -rf "$2"
}
for recipe in "$repo"/tests/fixtures/recipes/*.yml; do
    name=$(basename "$recipe" .yml)
    # A recipe the models cannot take (slices of 2 layers on a 37-layer synthetic model) prints
    # its error, which must not change either.
    if err=$("$bin" run "$recipe" -q --device "$device" -o "out-$name" 2>&1 >/dev/null); then
        print "$name" "out-$name"
    else
        printf '%s error %s\n' "$name" "${err//$dir/DIR}"
    fi
done
agents=(--model coding-agent --model tool-agent --model memory-agent)
while read -r name args; do
    # shellcheck disable=SC2086
    "$bin" merge -q --device "$device" --base base "${agents[@]}" $args -o "out-$name" >/dev/null
    print "$name" "out-$name"
done <<'EOF'
cli-ram --method ram
cli-ram+ --method ram+
cli-ram+tensor --method ram+ --scope tensor
cli-ram+official --method ram+ --rule official --scope tensor
cli-ties --method ties --param weight=1 --param density=0.4
cli-dare_ties --method dare_ties --param weight=1 --param density=0.5 --seed 7
cli-della --method della --param weight=1 --param density=0.5 --param epsilon=0.1
cli-f16 --method ram --out-dtype float16
cli-ram-consensus --method ram --shared consensus
cli-ram+tensor-consensus --method ram+ --scope tensor --shared consensus
cli-iso_c --method iso_c --param scaling_factor=1.5
cli-tsv --method tsv --param scaling_factor=0.7
cli-resmerge --method resmerge --param rank_topk=2
cli-svc --method ties --param weight=1 --param density=0.5 --svc 0.1
EOF
printf 'merge_method: fisher\nmodels:\n  - model: coding-agent\n    parameters: {fisher: base}\n  - model: tool-agent\n    parameters: {fisher: memory-agent, weight: 2}\n' >fisher.yml
"$bin" run fisher.yml -q --device "$device" -o out-fisher >/dev/null
print fisher out-fisher
