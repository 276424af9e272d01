"""The installed package on a machine without a GPU: import, configure, the profiler, and
clean errors where a driver is needed. Run: python -m unittest discover -s python/tests"""

import os
import pathlib
import re
import threading
import unittest

import memres

#: What `stats` says of a device memres has not used.
ZERO = {
    k: 0
    for k in (
        "live_bytes",
        "peak_live_bytes",
        "allocated_bytes",
        "live_allocations",
        "peak_live_allocations",
        "allocations",
        "out_of_memory",
    )
}


class Package(unittest.TestCase):
    def test_the_library_is_bundled_or_named(self):
        path = pathlib.Path(memres.library_path())
        self.assertTrue(path.is_file(), path)
        self.assertEqual(path.name, "libmemres.so")
        bundled = pathlib.Path(memres.__file__).parent / "libmemres.so"
        if bundled.is_file() and not os.environ.get("MEMRES_LIB"):
            self.assertEqual(path, bundled)

    def test_configure_takes_a_spec_and_refuses_a_bad_one(self):
        memres.configure("statistics(virtual_pool:release=1GiB)")
        memres.configure("pool:initial=1GiB")
        with self.assertRaises(memres.MemresError) as caught:
            memres.configure("nonsense(")
        self.assertEqual(caught.exception.code, memres.ERROR_INVALID_ARGUMENT)
        self.assertIn("nonsense", str(caught.exception))

    def test_the_stats_struct_has_the_headers_fields_in_order(self):
        # The header installed with the package, else the repository's.
        here = pathlib.Path(memres.__file__).parent / "memres.h"
        repo = pathlib.Path(__file__).resolve().parents[2] / "capi" / "include" / "memres.h"
        header = (here if here.is_file() else repo).read_text()
        body = re.search(r"typedef struct memres_stats_t \{(.*?)\} memres_stats_t;", header, re.S)
        self.assertIsNotNone(body)
        fields = re.findall(r"^\s*u?int\d+_t (\w+);", body.group(1), re.M)
        self.assertEqual(fields, [name for name, _ in memres._native.Stats._fields_])

    def test_stats_of_a_device_not_yet_used_are_zero(self):
        self.assertEqual(memres.stats(0), ZERO)
        self.assertEqual(memres.tier_stats(0), [])
        memres.trim(0)
        memres.reset_peak(0)
        with self.assertRaises(memres.MemresError):
            memres.stats(-1)

    def test_without_a_driver_building_a_device_fails_cleanly(self):
        with self.assertRaises(memres.MemresError) as caught:
            memres.init_device(0)
        self.assertEqual(caught.exception.code, memres.ERROR_CUDA)
        self.assertIn("driver", str(caught.exception).lower())
        with self.assertRaises(memres.MemresError):
            memres.setup("virtual_pool", devices=[0], torch=False)

    def test_setup_says_at_once_what_is_missing(self):
        import ctypes
        import importlib.util

        try:
            ctypes.CDLL("libcuda.so.1")
            driver = True
        except OSError:
            driver = False
        if importlib.util.find_spec("torch") is None:
            with self.assertRaises(memres.MemresError) as caught:
                memres.setup("virtual_pool")
            self.assertIn("pip install torch", str(caught.exception))
            self.assertIn("torch=False", str(caught.exception))
        if importlib.util.find_spec("cupy") is None:
            with self.assertRaises(memres.MemresError) as caught:
                memres.setup("virtual_pool", torch=False, cupy=True)
            self.assertIn("cupy", str(caught.exception))
        if driver:
            mr = memres.setup("virtual_pool", torch=False)
            self.assertIsNone(mr.devices)
            return
        with self.assertRaises(memres.MemresError) as caught:
            memres.setup("virtual_pool", torch=False)
        self.assertEqual(caught.exception.code, memres.ERROR_CUDA)
        self.assertIn("no CUDA driver", str(caught.exception))

    def test_configure_takes_a_string(self):
        with self.assertRaises(TypeError) as caught:
            memres.configure(None)
        self.assertIn("spec", str(caught.exception))
        self.assertIn("str", str(caught.exception))

    def test_profile_scopes_nest_and_decorate(self):
        memres.profile_reset()

        @memres.profile("py.decorated")
        def work():
            with memres.profile("py.inner\tx", all_threads=False):
                pass

        with memres.profile("py.outer"):
            work()
            work()
        report = memres.profile_report().as_dict()
        self.assertEqual(report["py.outer"]["calls"], 1)
        self.assertEqual(report["py.decorated"]["calls"], 2)
        self.assertEqual(report["py.inner\tx"]["calls"], 2)
        self.assertEqual(report["py.outer"]["allocations"], 0)
        text = str(memres.profile_report())
        self.assertTrue(text.startswith("scope"), text)
        self.assertIn("py.decorated", text)
        memres.profile_reset()
        self.assertEqual(memres.profile_report().records, [])

    def test_a_scope_closes_on_the_thread_that_opened_it(self):
        scope = memres.profile("py.thread", all_threads=False).__enter__()
        failures = []

        def close_elsewhere():
            try:
                scope.__exit__(None, None, None)
            except memres.MemresError as e:
                failures.append(e)

        t = threading.Thread(target=close_elsewhere)
        t.start()
        t.join()
        self.assertEqual(len(failures), 1)
        self.assertIn("is open on this thread", str(failures[0]))
        scope.__exit__(None, None, None)
        self.assertEqual(memres.profile_report().as_dict()["py.thread"]["calls"], 1)


class Sleep(unittest.TestCase):
    def test_tags_nest_and_bad_sleep_arguments_are_refused_before_the_driver(self):
        with memres.tag("weights"):
            with memres.tag("kv_cache"):
                pass
        with self.assertRaises(ValueError):
            memres.tag("")
        with self.assertRaises(ValueError):
            memres.sleep("weights", mode="compress")
        with self.assertRaises(ValueError):
            memres.sleep({"weights": "keep"})

    def test_without_a_driver_sleep_and_wake_fail_cleanly(self):
        for call in (lambda: memres.sleep(), lambda: memres.wake("weights"), lambda: memres.is_asleep("weights"),
                     lambda: memres.prepare_offload("weights")):
            with self.assertRaises(memres.MemresError) as caught:
                call()
            self.assertEqual(caught.exception.code, memres.ERROR_CUDA)
            self.assertIn("driver", str(caught.exception).lower())

    def test_without_a_driver_peer_access_fails_cleanly(self):
        for device, peer in ((0, 1), (0, 0)):
            with self.assertRaises(memres.MemresError) as caught:
                memres.enable_peer_access(device, peer)
            self.assertEqual(caught.exception.code, memres.ERROR_CUDA)
            self.assertIn("driver", str(caught.exception).lower())
        with self.assertRaises(memres.MemresError) as caught:
            memres.enable_peer_access(0, -1)
        self.assertEqual(caught.exception.code, memres.ERROR_INVALID_ARGUMENT)
        with self.assertRaises(ValueError):
            memres.enable_peer_access(0, 2**40)
        with self.assertRaises(TypeError):
            memres.enable_peer_access(0, "1")


class Arguments(unittest.TestCase):
    """Bad arguments get Python's exceptions naming them, before the C ABI is called;
    what the C ABI refuses comes back as a MemresError; quoted input is cut."""

    def assert_names(self, error, kind, *words):
        self.assertIsInstance(error, kind)
        for word in words:
            self.assertIn(word, str(error))

    def test_arguments_of_the_wrong_type_are_type_errors_naming_them(self):
        cases = [
            (lambda: memres.profile(None), "name"),
            (lambda: memres.profile(b"forward"), "name"),
            (lambda: memres.profile("forward", all_threads="no"), "all_threads"),
            (lambda: memres.sleep(123), "tags"),
            (lambda: memres.sleep(["weights", 7]), "tags"),
            (lambda: memres.sleep(b"weights"), "tags"),
            (lambda: memres.sleep({"weights": 1}), "mode"),
            (lambda: memres.sleep("weights", mode=None), "mode"),
            (lambda: memres.sleep("weights", mode=["offload"]), "mode"),
            (lambda: memres.wake(123), "tags"),
            (lambda: memres.wake([None]), "tags"),
            (lambda: memres.prepare_offload(123), "tags"),
            (lambda: memres.prepare_offload(device="0"), "device"),
            (lambda: memres.is_asleep(None), "name"),
            (lambda: memres.stats("0"), "device"),
            (lambda: memres.stats(1.0), "device"),
            (lambda: memres.stats(True), "device"),
            (lambda: memres.tier_stats("0"), "device"),
            (lambda: memres.trim(None), "device"),
            (lambda: memres.reset_peak("0"), "device"),
            (lambda: memres.init_device("0"), "device"),
            (lambda: memres.sleep(device="0"), "device"),
            (lambda: memres.wake(device=[0]), "device"),
            (lambda: memres.is_asleep("weights", device="0"), "device"),
            (lambda: memres.setup("virtual_pool", devices=["0"], torch=False), "devices"),
            (lambda: memres.setup("virtual_pool", devices=0, torch=False), "devices"),
        ]
        for i, (call, word) in enumerate(cases):
            with self.subTest(case=i, argument=word):
                with self.assertRaises(TypeError) as caught:
                    call()
                self.assertIn(word, str(caught.exception))

    def test_values_the_c_abi_cannot_take_are_value_errors_naming_them(self):
        cases = [
            (lambda: memres.configure("pool\x00junk"), "spec", "NUL"),
            (lambda: memres.configure("pool\udc80"), "spec", "UTF-8"),
            (lambda: memres.tag("weights\x00kv"), "name", "NUL"),
            (lambda: memres.profile("forward\x00"), "name", "NUL"),
            (lambda: memres.sleep("weights\x00"), "tags", "NUL"),
            (lambda: memres.wake(["weights", "kv\x00"]), "tags", "NUL"),
            (lambda: memres.prepare_offload("weights\x00"), "tags", "NUL"),
            (lambda: memres.stats(10**30), "device", "C int"),
            (lambda: memres.stats(-(2**31) - 1), "device", "C int"),
            (lambda: memres.trim(2**31), "device", "C int"),
            (lambda: memres.sleep(device=2**40), "device", "C int"),
            (lambda: memres.sleep("weights", mode="compress"), "mode", "compress"),
        ]
        for i, (call, *words) in enumerate(cases):
            with self.subTest(case=i, words=words):
                with self.assertRaises(ValueError) as caught:
                    call()
                for word in words:
                    self.assertIn(word, str(caught.exception))
        # Refused before the C ABI: the configuration is what it was.
        memres.configure("pool")
        with self.assertRaises(ValueError):
            memres.configure("pool\x00junk")
        # A device ordinal a C int holds but memres does not serve: the C ABI's refusal.
        with self.assertRaises(memres.MemresError) as caught:
            memres.stats(64)
        self.assertEqual(caught.exception.code, memres.ERROR_INVALID_ARGUMENT)
        self.assertIn("device 64", str(caught.exception))

    def test_long_input_is_quoted_cut_with_its_size(self):
        long_spec = "x" * 100_000
        with self.assertRaises(memres.MemresError) as caught:
            memres.configure(long_spec)
        message = str(caught.exception)
        self.assertEqual(caught.exception.code, memres.ERROR_INVALID_ARGUMENT)
        self.assertLess(len(message), 1000, message[:300])
        self.assertIn("100000 bytes", message)
        for call, size in [
            (lambda: memres.sleep("weights", mode="k" * 100_000), "100000"),
            (lambda: memres.configure("pool\x00" + "j" * 100_000), "100005"),
            (lambda: memres.stats("7" * 100_000), "100000"),
            (lambda: memres.sleep(list(range(100_000))), ""),
        ]:
            with self.assertRaises((TypeError, ValueError)) as caught:
                call()
            message = str(caught.exception)
            self.assertLess(len(message), 1000, message[:300])
            self.assertIn(size, message)

    def test_messages_to_python_users_name_python_things(self):
        import ctypes

        try:
            ctypes.CDLL("libcuda.so.1")
            self.skipTest("a CUDA driver is present (this test is for machines without one)")
        except OSError:
            pass
        with self.assertRaises(memres.MemresError) as caught:
            memres.init_device(0)
        message = str(caught.exception)
        self.assertIn("driver", message)
        self.assertNotIn("HostHeap", message)


if __name__ == "__main__":
    unittest.main()
