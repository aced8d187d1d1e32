#!/usr/bin/env python3
"""The GPU backend next to the CPU backend on one machine, end to end.

Writes a synthetic base + 3 RL-like agents (`rlmerge demo --model-size SIZE --write-only`), then
times each method with `--device cpu`, `--device gpu` and `--device auto`, runs alternating, next
to the read limit (`cat` of every input + `cp -r` of the base) and the adapter's host→device copy
rate (`rlmerge devices --copy-rate`). Prints a Markdown table: median wall time, input GB/s, ratio
to the read limit, share of the copy rate, peak RSS — then the GPU backend's own account of its
last run per method (bytes up and down, time per phase, most chunks in flight). Standard library
only, so it runs on a bare GPU host with a prebuilt binary and no toolchain:

    benches/gpu_vs_cpu.py [--bin target/release/rlmerge] [--size 2GiB] [--runs 3] [--dir DIR]

Before every timed run the previous output is deleted and dirty pages are flushed (`sync`), so
no run pays for another's writeback.
"""

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import time

METHODS = [
    ["ram"],
    ["ram+"],
    ["task_arithmetic", "--param", "weight=0.5"],
    ["ties", "--param", "weight=1", "--param", "density=0.5"],
    ["dare_ties", "--param", "weight=1", "--param", "density=0.5"],
]
AGENTS = ["coding-agent", "tool-agent", "memory-agent"]


def timed(argv, out):
    """Wall seconds, peak RSS (MiB) and stderr of one command; its output folder is removed
    first."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{err}")
    return seconds, usage.ru_maxrss / 1024, err


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/rlmerge")
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="target/gpu-bench-models")
    args = ap.parse_args()

    marker = os.path.join(args.dir, f".size-{args.size}")
    if not os.path.exists(marker):
        shutil.rmtree(args.dir, ignore_errors=True)
        t, _, _ = timed([args.bin, "demo", args.dir, "--model-size", args.size, "--write-only",
                      "--quiet"], os.path.join(args.dir, ".none"))
        open(marker, "w").close()
        print(f"wrote the models in {t:.1f} s")
    files = sorted(
        f for m in ["base"] + AGENTS for f in glob.glob(os.path.join(args.dir, m, "*.safetensors"))
    )
    nbytes = sum(os.path.getsize(f) for f in files)
    out = os.path.join(args.dir, ".out")

    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the cache
    cat = statistics.median(timed(["cat", *files], out)[0] for _ in range(args.runs))
    rates = subprocess.run([args.bin, "devices", "--copy-rate"], capture_output=True, text=True,
                           check=True).stdout
    line = next((l for l in rates.splitlines() if l.startswith("copy rate on ")), None)
    # GB/s host to device: the most an elementwise merge on the GPU can reach end to end.
    copy_up = float(line.split(": ")[1].split(" ")[0]) if line else None
    print(line or "no GPU adapter: no copy rate")
    cp = statistics.median(
        timed(["cp", "-r", os.path.join(args.dir, "base"), out], out)[0] for _ in range(args.runs)
    )
    limit = cat + cp
    print(f"inputs {nbytes / 1e9:.2f} GB in {len(files)} files; cat {cat:.2f} s + cp {cp:.2f} s "
          f"= read limit {limit:.2f} s (median of {args.runs})\n")

    models = ["--base", os.path.join(args.dir, "base")]
    for a in AGENTS:
        models += ["--model", os.path.join(args.dir, a)]
    print("| method | device | median s | input GB/s | × read limit | % of copy rate | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    traffic = {}
    for method in METHODS:
        samples = {"cpu": [], "gpu": [], "auto": []}
        rss = {d: 0.0 for d in samples}
        for _ in range(args.runs):
            for device in samples:  # alternating, so drift hits all alike
                # Not --quiet on the GPU: its last stderr line says where the time went.
                quiet = [] if device == "gpu" else ["-q"]
                argv = [args.bin, "merge", *quiet, "--device", device, *models, "--method",
                        *method, "-o", out]
                t, r, err = timed(argv, out)
                samples[device].append(t)
                rss[device] = max(rss[device], r)
                traffic.update({method[0]: l for l in err.splitlines() if l.startswith("GPU: ")})
        for device, ts in samples.items():
            t = statistics.median(ts)
            rate = nbytes / t / 1e9
            share = f"{100 * rate / copy_up:.0f} %" if copy_up else "—"
            print(f"| {method[0]} | {device} | {t:.2f} | {rate:.2f} | {t / limit:.2f} | {share} "
                  f"| {rss[device]:.0f} MiB |", flush=True)
    print()
    for method, line in traffic.items():
        print(f"- {method}: {line}")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
