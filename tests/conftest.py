import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = [
    "tests.fixtures.core",
    "tests.fixtures.alfworld",
    "tests.fixtures.inference",
    "tests.fixtures.broker",
    "tests.fixtures.learner",
    "tests.fixtures.system",
    "tests.fixtures.calls",
]
