#!/usr/bin/env python3
"""Prints the loss-parity table and throughput summary of scripts/bench_training.sh.

Inputs: the JSON written by scripts/reference/train_reference.py (Modalities' components) and the
evaluation_results.jsonl of our `modalities run` on the same derived config (training log interval
1, so every line is one optimizer step: "train loss avg" is that step's loss, full float32
precision; "train samples/s" is the samples of that step over the time since the previous log).

Throughput: tokens/s from the median step time of steps 2..N (robust against other processes on a
shared machine; the first step pays first-touch allocations in both), from the mean over steps
2..N ("steady") and over all steps ("loop"). Both timers span the same work per step: batch
fetch, forward, backward, clipping, optimizer and scheduler step. Ours also includes writing the
log line and JSONL record of every step; Python's includes one loss.item() per step (Modalities).
Standard library only (run with python3); the reference JSON comes from the .deps/bench venv
(scripts/setup_bench_env.sh), whose torch version it records.
"""
import argparse
import json
import math
import statistics
import sys
import tomllib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="JSON from train_reference.py")
    ap.add_argument("--ours", required=True, help="evaluation_results.jsonl of modalities run")
    ap.add_argument("--config", required=True, help="the resolved config both ran (for the step profile)")
    ap.add_argument("--summary-json", help="also write the summary here")
    args = ap.parse_args()

    with open(args.config, "rb") as f:
        sp = tomllib.load(f)["settings"]["step_profile"]
    mbs = sp["local_train_micro_batch_size"]
    if isinstance(mbs, dict):  # number_conversion/local_micro_batch_size_from_global_batch_size, one process
        mbs = mbs["config"]["global_batch_size"] // mbs["config"]["gradient_accumulation_steps"]
    samples_per_step = mbs * sp["gradient_accumulation_steps"]
    tokens_per_step = samples_per_step * sp["sequence_length"]
    ref = json.load(open(args.reference))
    ours = {}
    for line in open(args.ours):
        r = json.loads(line)
        if r["dataloader_tag"] != "train" or "train loss avg" not in r["losses"]:
            continue
        ours[r["num_train_steps_done"]] = r
    n = len(ref["loss"])
    missing = [s for s in range(1, n + 1) if s not in ours]
    if missing:
        sys.exit(f"bench_training_compare.py: {args.ours} has no training record for steps {missing[:5]} "
                 f"(is training_log_interval_in_steps 1?)")

    print(f"{'step':>4} {'loss (Modalities)':>18} {'loss (ours)':>12} {'|dloss|':>9} "
          f"{'lr (Modalities)':>16} {'lr (ours)':>12} {'grad norm M/ours':>18} {'s/step M':>9} {'s/step ours':>11}")
    dl, dlr, ours_s = [], [], []
    for step in range(1, n + 1):
        r = ours[step]
        lo = r["losses"]["train loss avg"]
        lp = ref["loss"][step - 1]
        lr_o = r["throughput_metrics"]["lr mean"]
        lrs_p = ref["lr"][step - 1]
        lr_p = sum(lrs_p) / len(lrs_p)
        sps = r["throughput_metrics"]["train samples/s"]
        so = samples_per_step / sps if sps > 0 else math.nan
        sp = ref["step_seconds"][step - 1]
        dl.append(abs(lo - lp))
        dlr.append(abs(lr_o - lr_p) / lr_p)
        ours_s.append(so)
        gn = f"{ref['grad_norm'][step - 1]:.4f}/{r['metrics']['grad norm last']:.4f}"
        print(f"{step:>4} {lp:>18.6f} {lo:>12.6f} {dl[-1]:>9.2e} {lr_p:>16.8g} {lr_o:>12.8g} {gn:>18} "
              f"{sp:>9.3f} {so:>11.3f}")

    def tps(seconds):
        return tokens_per_step * len(seconds) / sum(seconds)

    def tps_median(seconds):
        return tokens_per_step / statistics.median(seconds)

    s = {
        "steps": n,
        "max_abs_dloss_first_10": max(dl[:10]),
        "max_abs_dloss_all": max(dl),
        "max_rel_dlr": max(dlr),
        "final_loss_modalities": ref["loss"][-1],
        "final_loss_ours": ours[n]["losses"]["train loss avg"],
        "tokens_per_s_modalities_median": tps_median(ref["step_seconds"][1:]),
        "tokens_per_s_ours_median": tps_median(ours_s[1:]),
        "tokens_per_s_modalities_steady": tps(ref["step_seconds"][1:]),
        "tokens_per_s_ours_steady": tps(ours_s[1:]),
        "tokens_per_s_modalities_loop": tps(ref["step_seconds"]),
        "tokens_per_s_ours_loop": tps(ours_s),
        "torch_python": ref.get("torch"),
        "threads_python": ref.get("threads"),
    }
    s["ratio_ours_over_modalities_median"] = s["tokens_per_s_ours_median"] / s["tokens_per_s_modalities_median"]
    s["ratio_ours_over_modalities_steady"] = s["tokens_per_s_ours_steady"] / s["tokens_per_s_modalities_steady"]
    s["ratio_ours_over_modalities_loop"] = s["tokens_per_s_ours_loop"] / s["tokens_per_s_modalities_loop"]
    print()
    print(f"steps: {n}; max |dloss| steps 1-{min(10, n)}: {s['max_abs_dloss_first_10']:.2e}, "
          f"all steps: {s['max_abs_dloss_all']:.2e}; max relative lr difference: {s['max_rel_dlr']:.1e}")
    print(f"final loss: Modalities {s['final_loss_modalities']:.6f}, ours {s['final_loss_ours']:.6f}")
    print(f"tokens/s from the median step time, steps 2-{n}: Modalities {s['tokens_per_s_modalities_median']:.0f}, "
          f"ours {s['tokens_per_s_ours_median']:.0f}, ours/Modalities {s['ratio_ours_over_modalities_median']:.2f}")
    print(f"tokens/s mean over steps 2-{n}: Modalities {s['tokens_per_s_modalities_steady']:.0f}, "
          f"ours {s['tokens_per_s_ours_steady']:.0f}, ours/Modalities {s['ratio_ours_over_modalities_steady']:.2f}")
    print(f"tokens/s all steps: Modalities {s['tokens_per_s_modalities_loop']:.0f}, "
          f"ours {s['tokens_per_s_ours_loop']:.0f}, ours/Modalities {s['ratio_ours_over_modalities_loop']:.2f}")
    if args.summary_json:
        json.dump(s, open(args.summary_json, "w"), indent=1)


if __name__ == "__main__":
    main()
