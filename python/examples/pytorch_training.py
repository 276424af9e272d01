"""Training a PyTorch model on memory from memres: one call to set up, a profile of where
the memory goes, and the figures at the end.

    pip install ./python          # from a checkout: builds and bundles libmemres.so
    python3 python/examples/pytorch_training.py

Needs PyTorch and a CUDA GPU; without one it says so and exits. (The fuller proofs, with
GPT-2 and ResNet-50 next to PyTorch's own allocator, are in ``python/proofs/``.)
"""

import sys

import memres


def main() -> int:
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: pip install torch")
        return 1
    if not torch.cuda.is_available():
        print("no CUDA GPU here: memres would give PyTorch its memory on one")
        return 0
    # Before PyTorch's first CUDA allocation: memres's default stack (a pool that grows
    # in place over CUDA virtual memory) becomes PyTorch's allocator on every device.
    mr = memres.setup()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(50):
        x = torch.randn(64 + step % 7 * 32, 1024, device="cuda")
        with memres.profile("forward"):
            loss = model(x).square().mean()
        with memres.profile("backward"):
            loss.backward()
        with memres.profile("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"loss after 50 steps: {loss.item():.5f}")
    print(memres.profile_report())  # scopes, highest peak first
    for device, figures in mr.stats().items():
        print(f"device {device}: {figures}")
    mr.trim()  # give what the pool holds but does not use back to the driver
    return 0


if __name__ == "__main__":
    sys.exit(main())
