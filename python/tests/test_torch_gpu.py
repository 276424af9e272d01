"""PyTorch's allocator APIs under memres on a GPU: every check of
python/proofs/torch_parity.py, each in fresh processes under torch's allocator and under
memres, must pass under memres wherever it passes under torch. Skipped, saying why, on a
machine without torch or a CUDA device (CI has neither).

    python -m unittest discover -s python/tests -p 'test_torch_gpu.py' -v
"""

import importlib.util
import pathlib
import subprocess
import sys
import unittest

PARITY = pathlib.Path(__file__).resolve().parents[1] / "proofs" / "torch_parity.py"


def cuda_available():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


@unittest.skipUnless(cuda_available(), "memres-skip: needs torch and a CUDA device")
class TorchParity(unittest.TestCase):
    def run_checks(self, checks):
        done = subprocess.run(
            [sys.executable, str(PARITY), "--checks", ",".join(checks)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        self.assertEqual(done.returncode, 0, done.stdout[-4000:] + done.stderr[-2000:])

    def test_record_stream_stats_empty_cache_and_oom(self):
        self.run_checks(["record_stream", "stats", "empty_cache", "oom", "cudnn", "bad_input"])

    def test_graphs_pools_and_compile(self):
        self.run_checks(["graphs", "graph_pools", "pool_record_stream", "compile"])

    def test_snapshots_and_ipc(self):
        self.run_checks(["snapshot", "ipc", "ipc_pool"])

    def test_fraction_oom_text_observers_and_profiler(self):
        self.run_checks(["fraction", "oom_text", "oom_observer_raises", "profiler"])

    def test_ipc_with_torchs_own_allocator_and_other_allocators_pools(self):
        self.run_checks(
            ["ipc_to_torch", "ipc_to_torch_expandable", "ipc_from_torch_expandable", "mempool_other_allocator"]
        )

    def test_pools_in_snapshots_and_history_options(self):
        self.run_checks(["mempool_snapshot", "graph_pool_blocks", "nested_pools", "no_split", "history_options"])

    def test_allocator_settings_and_capture_reuse(self):
        self.run_checks(["caching_off", "roundup", "capture_reuse", "checkpoint_pending"])

    def test_ipc_on_the_second_gpu(self):
        import torch

        if torch.cuda.device_count() < 2:
            self.skipTest("memres-skip: needs two CUDA devices")
        self.run_checks(["ipc_second_gpu", "ipc_to_torch_second_gpu", "ipc_from_torch_second_gpu"])


if __name__ == "__main__":
    unittest.main()
