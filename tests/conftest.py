import os

# Triton reads this at import time: kernels run in its interpreter on machines without a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# Longest first: `make test` runs two workers that each take a whole test file at a time, in
# collection order, so the files that run for minutes (real fleets, real engines) start first and the
# seconds-long ones fill in around them. The order inside a file is left as written.
LONGEST_FIRST = ("tests/e2e/test_scenarios.py", "tests/e2e/test_builtin_example.py", "tests/e2e/",
                 "tests/engine/test_model_parity.py")


def _file_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    slow = {_file_of(item) for item in items if item.get_closest_marker("slow")}

    def weight(item) -> int:
        path = _file_of(item)
        for rank, prefix in enumerate(LONGEST_FIRST):
            if path.startswith(prefix):
                return rank
        return len(LONGEST_FIRST) + (0 if path in slow else 1)
    items.sort(key=weight)   # stable, and one weight per file: a file's tests stay together, in order
