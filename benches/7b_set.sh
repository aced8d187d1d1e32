# Sourced by the benches that run at Llama-7B's shapes (end_to_end.sh's BENCH_SET=7b,
# extract_lora.sh, moe.sh): one set for all of them, so their figures are of the same models.
#
#   write_7b_set DIR PYTHON [AGENT...]
#
# writes into DIR, where not written already (a `.size-7b` mark), a base of
# benches/write_7b_shapes.py (the 32000 x 4096 embeddings and head, 2 decoder layers: 1.33 GB)
# and the RL-like agents of it that are named (all three by default; benches/write_7b_agent.py
# with PYTHON, which needs numpy): coding-agent, tool-agent and memory-agent, with 5, 25 and
# 50 % of each matrix moved by 1-4 bf16 steps.
write_7b_set() {
    local dir=$1 py=$2
    shift 2
    local wanted=("$@")
    if [ ${#wanted[@]} -eq 0 ]; then wanted=(coding-agent tool-agent memory-agent); fi
    if [ ! -f "$dir/base/.size-7b" ]; then
        rm -rf "$dir/base"
        python3 benches/write_7b_shapes.py "$dir/base" 2 >/dev/null
        touch "$dir/base/.size-7b"
    fi
    local a m density seed
    for a in "coding-agent 0.05 1" "tool-agent 0.25 2" "memory-agent 0.5 3"; do
        read -r m density seed <<<"$a"
        if [[ " ${wanted[*]} " =~ " $m " ]] && [ ! -f "$dir/$m/.size-7b" ]; then
            rm -rf "${dir:?}/$m"
            "$py" benches/write_7b_agent.py "$dir/base" "$dir/$m" "$density" "$seed" >/dev/null
            touch "$dir/$m/.size-7b"
        fi
    done
}
