"""torch.compile(mode="reduce-overhead") on GPT-2 inference under memres (CUDA graph trees
over memres's private graph pools), checked against the eager model.

    python3 python/proofs/compile_proof.py [--allocator memres|torch] [--batches 1,4,1,4]

GPT-2 small from its config (random weights, no download), eval mode, no grad; each
batch size in turn (sequence length 128) runs three times through the compiled model
(the third a replay of its CUDA graph); the logits must match the eager model's within
1e-3 (TF32 off). Prints the worst difference, the time of the last call per batch size,
and the allocator's figures; exit status 0 when all match.
"""

import argparse
import json
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--allocator", default="memres", choices=["memres", "torch"])
    p.add_argument("--batches", default="1,4,1,4")
    a = p.parse_args()
    if a.allocator == "memres":
        import memres

        memres.setup()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    worst, times = 0.0, {}
    with torch.no_grad():
        for batch in [int(b) for b in a.batches.split(",")]:
            ids = torch.randint(0, 50257, (batch, 128), device="cuda")
            for _ in range(3):
                t = time.perf_counter()
                got = compiled(input_ids=ids).logits.clone()
                torch.cuda.synchronize()
                times[batch] = round((time.perf_counter() - t) * 1e3, 2)
            want = model(input_ids=ids).logits
            worst = max(worst, (got - want).abs().max().item())
    report = {
        "allocator": a.allocator,
        "max_diff": worst,
        "last_call_ms": times,
        "memory_allocated": torch.cuda.memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
    }
    if a.allocator == "memres":
        import memres

        report["backend"] = memres.torch_backend()
    ok = worst < 1e-3
    print(json.dumps(report))
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
