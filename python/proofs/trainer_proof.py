"""Hugging Face's Trainer with its memory metrics on, under torch's allocator and memres.

    python3 python/proofs/trainer_proof.py [--steps 50]   # both allocators; exit 0 when memres matches

GPT-2 small built from its config (random weights, no download) trains for 50 steps on
random tokens with `skip_memory_metrics=False`: the Trainer then calls
`torch.cuda.reset_peak_memory_stats`, `memory_allocated` and `max_memory_allocated`
around training, which raised under memres's pluggable allocator. Each allocator runs in
its own process (`torch`, and `memres`: `memres.setup()`, the native backend), same seed;
the script prints the Trainer's metrics for both and checks that memres's run finished,
reported its memory metrics, and trained to the same loss within a tolerance (kernels
with atomics reduce in varying order).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(allocator, steps):
    if allocator == "memres":
        import memres

        memres.setup()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50257, (steps * 8, 256), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=8,
            learning_rate=1e-4,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            skip_memory_metrics=False,
            bf16=True,
            seed=0,
            dataloader_num_workers=0,
        )
        result = Trainer(model=model, args=args, train_dataset=data).train()
    metrics = dict(result.metrics)
    metrics["final_loss"] = result.training_loss
    if allocator == "memres":
        import memres

        metrics["backend"] = memres.torch_backend()
        metrics["memres_peak_live_bytes"] = memres.stats(0)["peak_live_bytes"]
    print(json.dumps(metrics))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    a = parser.parse_args()
    results = {}
    for allocator in ("torch", "memres"):
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", allocator, str(a.steps)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:])
            results[allocator] = {"error": f"exit {done.returncode}"}
        else:
            results[allocator] = json.loads(done.stdout.strip().splitlines()[-1])
        print(allocator, json.dumps(results[allocator]), flush=True)
    t, m = results["torch"], results["memres"]
    keys = [k for k in t if k.startswith("train_mem_gpu")]
    ok = (
        "error" not in m
        and m.get("backend") == "native"
        and all(k in m for k in keys)
        and len(keys) > 0
        and abs(m["final_loss"] - t["final_loss"]) < 0.05 * abs(t["final_loss"])
    )
    print("memory metrics:", {k: (t.get(k), m.get(k)) for k in keys})
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        run(sys.argv[2], int(sys.argv[3]))
    else:
        main()
