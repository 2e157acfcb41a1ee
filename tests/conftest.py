import os
import pathlib
import shutil
import tempfile

import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Compiling is most of the suite's time, and the same small programs (eager operations above all) are compiled in
# many files: XLA's persistent cache, in a folder of this run's own that the pytest-xdist workers share (they inherit
# its path from the main process), compiles each of them once per run. Nothing is kept between runs. The cache takes
# no lock: an entry read while another process writes it, or not written (a full disk), is compiled again, with a
# warning that pyproject.toml's `filterwarnings` lets pass.
_CACHE = "EQX_QUANT_TEST_COMPILATION_CACHE"
_created_cache = None


def pytest_configure(config):
    global _created_cache
    if _CACHE not in os.environ:
        _created_cache = os.environ[_CACHE] = tempfile.mkdtemp(prefix="eqx_quant-jax-cache-")
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's in-memory caches of compiled programs after each test file. Each program XLA compiles for the CPU
    keeps memory mappings while it is cached, and a worker of `pytest --all` compiles thousands: one reached 45,000
    of Linux's default 65,530 mappings and another died of a segmentation fault inside XLA at the limit. Programs
    the next files need again come from the persistent cache on disk."""
    yield
    jax.clear_caches()


def pytest_unconfigure(config):
    if _created_cache is not None:
        shutil.rmtree(_created_cache, ignore_errors=True)
        os.environ.pop(_CACHE, None)


# pytest-xdist (pyproject.toml) hands whole files to its workers in the order collected: the longest files go first,
# so that none of them is left to run alone at the end.
_LONGEST_FIRST = (  # by the seconds each file's tests took (`--durations=0`), the one long sharded test first
    "test_sharding.py",
    "test_docs.py",
    "test_smoothing.py",
    "test_traced.py",
    "test_convert.py",
    "test_quantizers.py",
    "test_lm_bench.py",
    "test_float_quantizers.py",
    "test_autoround.py",
    "test_formats.py",
    "test_forward_mode.py",
    "test_gptq.py",
    "test_models.py",
    "test_edge_cases.py",
    "test_stacked.py",
    "test_x64.py",
)


# Two tiers. `pytest` runs the tests not marked `slow`: the tier that CI runs (parametrized slow tests keep a cheap
# case in it, `helpers.slow_unless`), and every test of the files and tests named on the command line. `pytest --all`
# runs every test. An explicit `-m` chooses for itself.
def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="also run the tests marked slow (left out by default)")


def _leaves_out_slow(config) -> bool:
    return not config.getoption("--all") and not config.getoption("markexpr")


def pytest_report_header(config):
    if _leaves_out_slow(config):
        return "tier: the tests not marked slow, and those of the files named (`pytest --all` runs every test)"
    return None


def _named(config, item) -> bool:
    """Whether `item` is in a file, or is a test, that the command line names (not a folder)."""
    for arg in config.args:
        file, _, name = arg.partition("::")
        path = pathlib.Path(file).resolve()
        if path.is_file() and item.path == path and (not name or item.nodeid.split("::", 1)[1].startswith(name)):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: the rest keep their order
    if _leaves_out_slow(config):
        slow = [item for item in items if item.get_closest_marker("slow") is not None and not _named(config, item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            left_out = {id(item) for item in slow}
            items[:] = [item for item in items if id(item) not in left_out]


@pytest.fixture
def getkey():
    """A function that returns a fresh PRNG key at each call."""
    key = jax.random.key(0)

    def _getkey():
        nonlocal key
        key, subkey = jax.random.split(key)
        return subkey

    return _getkey
