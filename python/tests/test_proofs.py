"""The proofs' verdicts that need no GPU (the proofs themselves run on one)."""

import importlib.util
import os
import unittest

PROOFS = os.path.join(os.path.dirname(__file__), os.pardir, "proofs")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(PROOFS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ModelsProofSpeedVerdict(unittest.TestCase):
    def setUp(self):
        self.proof = load("models_proof")

    def test_fewer_rounds_than_a_verdict_needs_judge_nothing(self):
        # One round's medians moved by +-50% between processes (GPT-2 inference).
        self.assertEqual(self.proof.speed_failures("gpt2_infer", "memres", "torch", 1.48, 1), [])
        self.assertEqual(self.proof.speed_failures("gpt2_infer", "memres", "torch", 1.48, 2), [])

    def test_paired_rounds_fail_a_mode_slower_than_the_tolerance(self):
        failures = self.proof.speed_failures("resnet50", "memres", "expandable", 1.05, 3)
        self.assertEqual(len(failures), 1)
        self.assertIn("resnet50", failures[0])
        self.assertIn("expandable", failures[0])

    def test_paired_rounds_pass_a_mode_within_the_tolerance(self):
        self.assertEqual(self.proof.speed_failures("resnet50", "memres", "torch", 1.019, 3), [])
        self.assertEqual(self.proof.speed_failures("gpt2", "memres", "torch", 0.786, 5), [])

    def test_the_paired_ratio_is_taken_step_by_step(self):
        # Step i of one run against step i of the other, after the third: a run whose
        # steps are each 10% longer is 1.1 of the other, whatever the shapes did.
        base = {"step_times_s_all": [9.0, 9.0, 9.0, 1.0, 2.0, 4.0, 8.0]}
        slower = {"step_times_s_all": [1.0, 1.0, 1.0, 1.1, 2.2, 4.4, 8.8]}
        self.assertAlmostEqual(self.proof.paired_ratio([slower], [base]), 1.1)


if __name__ == "__main__":
    unittest.main()
