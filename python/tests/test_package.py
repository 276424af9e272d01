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
        self.assertIn("spec string", str(caught.exception))

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


if __name__ == "__main__":
    unittest.main()


class Sleep(unittest.TestCase):
    def test_tags_nest_and_bad_sleep_arguments_are_refused_before_the_driver(self):
        with memres.tag("weights"):
            with memres.tag("kv_cache"):
                pass
        with self.assertRaises(TypeError):
            memres.tag("")
        with self.assertRaises(ValueError):
            memres.sleep("weights", mode="compress")
        with self.assertRaises(ValueError):
            memres.sleep({"weights": "keep"})

    def test_without_a_driver_sleep_and_wake_fail_cleanly(self):
        for call in (lambda: memres.sleep(), lambda: memres.wake("weights"), lambda: memres.is_asleep("weights")):
            with self.assertRaises(memres.MemresError) as caught:
                call()
            self.assertEqual(caught.exception.code, memres.ERROR_CUDA)
            self.assertIn("driver", str(caught.exception).lower())
